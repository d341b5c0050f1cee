"""VLLMBackend: the parts that need no vLLM run everywhere; the engine tests need vLLM and a CUDA GPU.

The GPU tests run on a copy of the tiny policy with 64-wide attention heads (the session policy's 16-wide
heads are below what vLLM's attention kernels accept).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.tiny_models import TinyModelPaths, build_policy, build_tokenizer
from server.backends import make_backend
from server.backends.base import GenerationRequest, WeightsError
from server.backends.hf import trim_at_stop
from server.backends.vllm_backend import (
    RewardMeshWorkerExtension,
    VLLMBackend,
    checkpoint_specs,
    pack_chunks,
)

REPO = Path(__file__).resolve().parents[1]


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def perturbed(state: dict[str, torch.Tensor], scale: float = 0.5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {name: t + scale * torch.randn(t.shape, generator=gen) for name, t in state.items()}


# ------------------------------------------------------------------------------------- no vLLM needed


def test_module_imports_without_vllm() -> None:
    code = "import sys, server.backends.vllm_backend; assert 'vllm' not in sys.modules, 'vllm imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_checkpoint_specs_match_the_transformers_state_dict(tiny_models: TinyModelPaths) -> None:
    specs = checkpoint_specs(tiny_models.policy)
    state = state_dict(tiny_models.policy)
    assert set(specs) == set(state)  # lm_head.weight included: the policy ties its embeddings
    assert all(specs[n] == (tuple(t.shape), t.dtype) for n, t in state.items())


def test_backend_constructs_and_validates_without_vllm(tiny_models: TinyModelPaths) -> None:
    backend = make_backend("vllm", str(tiny_models.policy), gpu_memory_utilization=0.3)
    assert isinstance(backend, VLLMBackend)
    assert (backend.name, backend.max_model_len, backend.policy_version, backend.running) == ("vllm", 512, 0, 0)
    assert backend.tokenizer.eos_token == "<|im_end|>"
    assert backend.weight_specs() == checkpoint_specs(tiny_models.policy)

    good = perturbed(state_dict(tiny_models.policy))
    backend.validate_weights(good)
    backend.validate_weights({k: v.to(torch.bfloat16) for k, v in list(good.items())[:3]})
    cases = [
        ({"model.no_such.weight": torch.zeros(2)}, "model.no_such.weight"),
        ({"model.norm.weight": torch.zeros(65)}, r"model\.norm\.weight.*shape"),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, r"model\.norm\.weight.*dtype"),
    ]
    for bad, message in cases:
        with pytest.raises(WeightsError, match=message):
            backend.validate_weights({**good, **bad})


async def test_bad_weights_fail_before_the_engine_is_touched(tiny_models: TinyModelPaths) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    with pytest.raises(WeightsError, match=r"lm_head\.bias"):
        await backend.update_weights({"lm_head.bias": torch.zeros(3)}, version=1)
    assert backend.policy_version == 0 and backend._engine is None


async def test_prompt_beyond_max_model_len_is_rejected_before_the_engine(tiny_models: TinyModelPaths) -> None:
    backend = VLLMBackend(str(tiny_models.policy), max_model_len=32)
    assert backend.max_model_len == 32
    with pytest.raises(ValueError, match=r"max_tokens.*32"):
        await backend.generate(GenerationRequest(prompt_ids=[5] * 10, max_tokens=30))


def test_weights_travel_in_chunks_and_apply_on_commit(tiny_models: TinyModelPaths) -> None:
    state = state_dict(tiny_models.policy)
    sent = {k: (v.to(torch.bfloat16) if "mlp" in k else v) for k, v in perturbed(state).items()}
    sent["lm_head.weight"] = sent["model.embed_tokens.weight"]  # tied: same storage, as in a real state dict
    chunks = pack_chunks(sent, skip={"lm_head.weight"}, chunk_bytes=64 * 1024)
    assert len(chunks) > 2 and all(isinstance(c, bytes) for c in chunks)

    loaded: list[tuple[str, torch.Tensor]] = []
    worker: Any = RewardMeshWorkerExtension()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=loaded.extend))
    for chunk in chunks:
        worker.rewardmesh_stage_weights(chunk)
    assert loaded == []  # nothing lands before the commit
    assert worker.rewardmesh_commit_weights() == len(sent) - 1
    got = dict(loaded)
    assert set(got) == set(sent) - {"lm_head.weight"}
    assert all(got[k].dtype == sent[k].dtype and torch.equal(got[k], sent[k]) for k in got)

    worker.rewardmesh_stage_weights(chunks[0])
    assert worker.rewardmesh_discard_weights() > 0
    assert worker.rewardmesh_commit_weights() == 0  # a discarded stage is gone


def test_outputs_drop_stop_strings_like_the_hf_backend(tiny_models: TinyModelPaths) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    tok = backend.tokenizer
    tokens = tok.encode("The cat reads a book. The end!")
    request = GenerationRequest(prompt_ids=[1], max_tokens=50, stop=["book"])
    completion = SimpleNamespace(token_ids=tokens, finish_reason="stop", stop_reason="book")
    out = backend._to_output(request, SimpleNamespace(outputs=[completion]), version=4)
    assert out.token_ids == trim_at_stop(tok, tokens, ["book"])
    assert tok.decode(out.token_ids) == "The cat reads a"  # " book" is one token: dropped whole
    assert (out.finish_reason, out.num_preempted, out.policy_version) == ("stop", -1, 4)
    length = SimpleNamespace(token_ids=tokens, finish_reason="length", stop_reason=None)
    assert backend._to_output(request, SimpleNamespace(outputs=[length]), 0).token_ids == tokens


# ----------------------------------------------------------------------------------- vLLM on a GPU


@pytest.fixture(scope="module")
def gpu_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    return build_policy(tmp_path_factory.mktemp("vllm-policy") / "policy", build_tokenizer(), hidden=128, heads=2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(gpu_policy: Path) -> AsyncIterator[VLLMBackend]:
    backend = VLLMBackend(str(gpu_policy), gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=512)
    await backend.start()
    yield backend
    await backend.close()


gpu = pytest.mark.asyncio(loop_scope="module")


def greedy(prompt: list[int], max_tokens: int = 16, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, **kw)


def prompts(engine: VLLMBackend) -> list[list[int]]:
    texts = ["What is 2 + 2?", "Tell me a short story about a cat.", "7 + 8 =", "Add 9 and 9."]
    return [list(engine.tokenizer.encode(t)) for t in texts]


@gpu
async def test_vllm_generates_deterministically(engine: VLLMBackend) -> None:
    ps = prompts(engine)
    first = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    second = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    for out in first:
        assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 16
        assert out.finish_reason == "stop" or len(out.token_ids) == 16
        assert out.policy_version == engine.policy_version and out.num_preempted == -1
    seeded = GenerationRequest(ps[1], max_tokens=24, temperature=1.0, seed=7)
    assert (await engine.generate(seeded)).token_ids == (await engine.generate(seeded)).token_ids
    assert engine.running == 0


@gpu
async def test_vllm_honours_stop_tokens_and_strings(engine: VLLMBackend) -> None:
    tok = engine.tokenizer
    for seed in range(30):
        request = GenerationRequest(prompts(engine)[0], max_tokens=30, temperature=1.0, seed=seed)
        tokens = (await engine.generate(request)).token_ids
        if len(tokens) == 30:
            break
    else:
        pytest.skip("every seed hit eos early")
    k = next(i for i in range(5, 30) if tokens[i] not in tokens[:i])
    request.stop_token_ids = [tokens[k]]
    out = await engine.generate(request)
    assert (out.finish_reason, out.token_ids) == ("stop", tokens[: k + 1])

    request.stop_token_ids = []
    text = tok.decode(tokens, skip_special_tokens=True)
    start = len(tok.decode(tokens[:4], skip_special_tokens=True))
    pos, stop = next(
        (p, text[p : p + 2])
        for p in range(start, len(text) - 2)
        if text[p : p + 2].isascii() and text[p : p + 2].isprintable() and text[p : p + 2] not in text[: p + 1]
    )
    request.stop = [stop]
    out = await engine.generate(request)
    assert out.finish_reason == "stop"
    assert out.token_ids == trim_at_stop(tok, tokens, [stop])
    kept = tok.decode(out.token_ids, skip_special_tokens=True)
    assert stop not in kept and len(kept) <= pos


@gpu
async def test_vllm_cancellation_aborts(engine: VLLMBackend) -> None:
    task = asyncio.create_task(engine.generate(greedy(prompts(engine)[3], max_tokens=480)))
    deadline = time.monotonic() + 5
    while engine.running == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)
    if task.done():
        pytest.skip("the request finished (eos) before it could be cancelled")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.running == 0
    # the engine keeps serving
    assert (await engine.generate(greedy(prompts(engine)[0], max_tokens=4))).token_ids


@gpu
async def test_vllm_update_weights(engine: VLLMBackend, gpu_policy: Path) -> None:
    ps = prompts(engine)
    before = [o.token_ids for o in await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))]
    original = state_dict(gpu_policy)

    with pytest.raises(WeightsError, match=r"model\.norm\.weight"):
        await engine.update_weights({**original, "model.norm.weight": torch.zeros(3)}, version=99)
    assert engine.policy_version == 0
    assert [o.token_ids for o in await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))] == before

    await engine.update_weights(perturbed(original), version=5)
    after = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    assert engine.policy_version == 5 and all(o.policy_version == 5 for o in after)
    assert [o.token_ids for o in after] != before

    await engine.update_weights(original, version=6)
    restored = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    assert [o.token_ids for o in restored] == before


@gpu
async def test_vllm_weight_specs(engine: VLLMBackend, gpu_policy: Path) -> None:
    specs = engine.weight_specs()
    state = state_dict(gpu_policy)
    assert set(specs) == set(state)
    assert all(specs[n][0] == tuple(t.shape) for n, t in state.items())
    assert {dtype for _, dtype in specs.values()} <= {torch.bfloat16, torch.float16, torch.float32}


def test_tokenizer_is_the_policy_tokenizer(tiny_models: TinyModelPaths) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    reference = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    assert backend.tokenizer.get_vocab() == reference.get_vocab()
