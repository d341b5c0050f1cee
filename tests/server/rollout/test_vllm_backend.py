"""VLLMBackend: the parts that need no vLLM run everywhere (with a stand-in for vLLM's API); the engine tests run
on vLLM itself wherever it is installed: its CPU build (`make test-vllm`, every CI run) or a GPU build.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.mesh import reward_server
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.cli import build_parser
from rewardmesh.server.config import resolve
from rewardmesh.server.rollout.agent_loop import AgentSettings
from rewardmesh.server.rollout.backends import make_backend
from rewardmesh.server.rollout.backends.base import (
    GenerationFailed,
    GenerationOutput,
    GenerationRequest,
    WeightsError,
    WeightsNotApplied,
)
from rewardmesh.server.rollout.backends.requests import trim_at_stop
from rewardmesh.server.rollout.backends.vllm_backend import (
    RewardMeshWorkerExtension,
    VLLMBackend,
    checkpoint_specs,
    iter_chunks,
    pack_chunks,
    parse_engine_args,
)
from rewardmesh.server.rollout.backends.vllm_engine import STREAM_INTERVAL, engine_args_from_env
from rewardmesh.server.rollout.server import SERVICE_NAME as ROLLOUT_SERVICE
from rewardmesh.server.rollout.server import RolloutServer, RolloutServerConfig, backend_options
from rewardmesh.server.rollout.worker import Job, PromptInput, RolloutWorker, RunSettings
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc
from tests.support.fake_vllm import FakeEngine, echo, installed
from tests.support.paths import REPO
from tests.support.waiting import eventually


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def perturbed(state: dict[str, torch.Tensor], scale: float = 0.5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {name: t + scale * torch.randn(t.shape, generator=gen) for name, t in state.items()}


# ------------------------------------------------------------------------------------- no vLLM needed


@pytest.mark.slow
def test_module_imports_without_vllm() -> None:
    code = (
        "import sys, rewardmesh.server.rollout.backends.vllm_backend; "
        "assert 'vllm' not in sys.modules, 'vllm imported eagerly'"
    )
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
        ({"model.norm.weight": torch.zeros(128, dtype=torch.int32)}, r"model\.norm\.weight.*dtype"),
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
    tok: Any = backend.tokenizer
    tokens = tok.encode("The cat reads a book. The end!")
    request = GenerationRequest(prompt_ids=[1], max_tokens=50, stop=["book"])
    completion = SimpleNamespace(token_ids=tokens, finish_reason="stop", stop_reason="book")
    out = backend._to_output(request, SimpleNamespace(outputs=[completion]), version=4)
    assert out.token_ids == trim_at_stop(tok, tokens, ["book"])
    assert tok.decode(out.token_ids) == "The cat reads a"  # " book" is one token: dropped whole
    assert (out.finish_reason, out.num_preempted, out.policy_version) == ("stop", -1, 4)
    length = SimpleNamespace(token_ids=tokens, finish_reason="length", stop_reason=None)
    assert backend._to_output(request, SimpleNamespace(outputs=[length]), 0).token_ids == tokens


def test_large_tensors_are_split_into_chunks_and_joined_in_the_worker() -> None:
    big = torch.randn(40, 30)  # 4800 bytes: split into 4 pieces of at most 1200 bytes
    tensors = {"small.a": torch.randn(10), "big": big, "small.b": torch.randn(5, dtype=torch.float16)}
    chunks = list(iter_chunks(tensors, chunk_bytes=1200))
    assert max(len(c) for c in chunks) < 1200 + 512  # a chunk never holds much more than its budget
    assert len(chunks) == 1 + 4 + 1
    loaded: list[tuple[str, torch.Tensor]] = []
    worker: Any = RewardMeshWorkerExtension()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=loaded.extend))
    for chunk in chunks[:-2]:
        worker.rewardmesh_stage_weights(chunk)
    assert "'big': 3 of 4 pieces" in worker.rewardmesh_check_weights(list(tensors))  # the refusal, as a result
    with pytest.raises(WeightsNotApplied, match=r"'big': 3 of 4 pieces"):
        worker.rewardmesh_commit_weights(list(tensors))
    assert loaded == []  # a missing piece applies nothing
    for chunk in chunks:
        worker.rewardmesh_stage_weights(chunk)
    with pytest.raises(WeightsNotApplied, match=r"missing \['small.c'\]"):
        worker.rewardmesh_commit_weights([*tensors, "small.c"])
    assert loaded == []
    for chunk in chunks:
        worker.rewardmesh_stage_weights(chunk)
    assert worker.rewardmesh_check_weights(list(tensors)) == "" and loaded == []  # checked, joined, not loaded
    assert worker.rewardmesh_commit_weights(list(tensors)) == 3
    got = dict(loaded)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_engine_args_are_parsed_as_yaml_scalars() -> None:
    parsed = parse_engine_args(["max-num-seqs=8", "enforce_eager=true", "attention_backend=TRITON_ATTN",
                                'compilation_config={"level": 0}', "gpu_memory_utilization=0.5"])  # fmt: skip
    assert parsed == {"max_num_seqs": 8, "enforce_eager": True, "attention_backend": "TRITON_ATTN",
                      "compilation_config": {"level": 0}, "gpu_memory_utilization": 0.5}  # fmt: skip
    assert parse_engine_args({"max-num-seqs": 4}) == {"max_num_seqs": 4}
    with pytest.raises(ValueError, match="'oops': expected KEY=VALUE"):
        parse_engine_args(["oops"])


# ------------------------------------------------------------------------- vLLM's API, with a CPU stand-in


@pytest.fixture
def fake_vllm(tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeEngine]]:
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)  # the backend sets it; restored after
    with installed(state_dict(tiny_models.policy)) as engine_cls:
        yield engine_cls


async def test_engine_args_reach_the_engine_and_unknown_ones_are_named(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    backend = VLLMBackend(str(tiny_models.policy), gpu_memory_utilization=0.3, tensor_parallel_size=1,
                          engine_args={"attention_backend": "TRITON_ATTN", "max_num_seqs": 8})  # fmt: skip
    backend.check_engine_args()
    await backend.start()
    args = fake_vllm.last.args if fake_vllm.last else None
    assert args is not None and args.attention_backend == "TRITON_ATTN" and args.max_num_seqs == 8
    assert args.gpu_memory_utilization == 0.3 and args.logprobs_mode == "processed_logprobs"
    assert args.worker_extension_cls.endswith("RewardMeshWorkerExtension")
    # offline LLM's defaults: its usage context (the scheduler limits it picks for the machine), no stats logging
    assert fake_vllm.last is not None and fake_vllm.last.usage_context.name == "LLM_CLASS"
    assert args.disable_log_stats is True
    await backend.close()
    stats = VLLMBackend(str(tiny_models.policy), engine_args={"disable_log_stats": False})
    await stats.start()
    assert fake_vllm.last is not None and fake_vllm.last.args.disable_log_stats is False  # asked for: on
    await stats.close()
    bad = VLLMBackend(str(tiny_models.policy), engine_args={"gpu_memory_utilisation": 0.5, "no_such_arg": 1})
    with pytest.raises(
        ValueError, match=r"'gpu_memory_utilisation' \(did you mean 'gpu_memory_utilization'\?\).*'no_such_arg'"
    ):
        bad.check_engine_args()
    with pytest.raises(ValueError, match="gpu_memory_utilisation"):
        await bad.start()


async def test_the_engine_boots_off_the_event_loop(tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]) -> None:
    fake_vllm.boot_seconds = 0.3
    backend = VLLMBackend(str(tiny_models.policy))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    assert not backend.ready
    await backend.start()
    task.cancel()
    assert backend.ready and ticks >= 5  # the loop kept running while the engine booted
    await backend.close()


async def test_generation_maps_logprobs_versions_preemptions_and_errors(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None and engine.label == "0"  # every token is labelled from the start
    out = await backend.generate(GenerationRequest([5, 6, 7], max_tokens=4, logprobs=True, temperature=0.7))
    assert engine.prompts[-1] == {"type": "token", "prompt_token_ids": [5, 6, 7]}  # tokens_input(), not TokensPrompt
    assert engine.params[-1].logprobs == 0 and engine.params[-1].temperature == 0.7
    assert out.token_ids == [7, 6, 5, 7] and out.num_preempted == 2
    assert out.logprobs == pytest.approx([-0.25, -0.26, -0.27, -0.28])
    assert out.token_versions == [0, 0, 0, 0] and out.policy_version == 0
    plain = await backend.generate(GenerationRequest([5], max_tokens=2))
    assert plain.logprobs is None and engine.params[-1].logprobs is None
    await backend.generate(GenerationRequest([5], max_tokens=6, ignore_eos=True, min_tokens=4))
    assert (engine.params[-1].ignore_eos, engine.params[-1].min_tokens) == (True, 4)
    await backend.generate(GenerationRequest([6], max_tokens=6, ignore_eos=True, min_tokens=4))
    assert engine.params[-1] is engine.params[-2]  # one SamplingParams per distinct setting, shared
    await backend.generate(GenerationRequest([6], max_tokens=6, ignore_eos=True, min_tokens=4, seed=1))
    assert engine.params[-1] is not engine.params[-2] and engine.params[-1].seed == 1

    def split(ids: list[int], params: Any, eng: FakeEngine) -> dict[str, Any]:
        spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=5)]
        return {**echo(ids, params, eng), "weight_versions": spans}

    engine.respond = split
    out = await backend.generate(GenerationRequest([1, 2], max_tokens=5))
    assert out.token_versions == [3, 3, 4, 4, 4] and out.policy_version == 3

    engine.respond = lambda ids, params, eng: {**echo(ids, params, eng), "finish_reason": "error"}
    with pytest.raises(GenerationFailed, match="finish_reason 'error'"):
        await backend.generate(GenerationRequest([1, 2], max_tokens=5))
    engine.respond = lambda ids, params, eng: {**echo(ids, params, eng), "finish_reason": "repetition"}
    assert (await backend.generate(GenerationRequest([1], max_tokens=3))).finish_reason == "stop"
    await backend.close()


async def test_a_group_is_one_request_of_deltas_each_sample_reported_as_it_ends(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    """n > 1: one request of n samples streamed as deltas (the stand-in sends each sample's first token, then its
    end); each sample is put together and reported when it ends, one that vLLM fails is that sample's error
    alone, and cancelling the group aborts the request."""
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None

    def by_seed(ids: list[int], params: Any, eng: FakeEngine) -> dict[str, Any]:
        k = params.seed - 10  # sample k of seed 10: it ends after (3 - k) ticks, sample 1 fails
        return {**echo(ids, params, eng), "seconds": 0.01 * (3 - k), "finish_reason": "error" if k == 1 else "length"}

    engine.respond = by_seed
    reported: list[tuple[int, GenerationOutput | Exception]] = []
    request = GenerationRequest([5, 6, 7], max_tokens=5, logprobs=True, seed=10)
    await backend.generate_group(request, 3, lambda k, out: reported.append((k, out)))
    assert len(engine.params) == 1 and engine.params[0].n == 3 and engine.params[0].seed == 10
    assert engine.params[0].output_kind.name == "DELTA"
    assert [k for k, _ in reported] == [2, 1, 0]  # as they end, not in index order
    outs = dict(reported)
    assert isinstance(outs[1], GenerationFailed)
    for k in (0, 2):
        out = outs[k]
        assert isinstance(out, GenerationOutput)
        assert out.token_ids == [7, 6, 5, 7, 6] and out.finish_reason == "length"  # both deltas, joined
        assert out.logprobs == pytest.approx([-0.25, -0.26, -0.27, -0.28, -0.29])
        assert out.token_versions == [0] * 5
    assert backend.running == 0
    greedy: list[tuple[int, GenerationOutput | Exception]] = []
    await backend.generate_group(GenerationRequest([5], 3, temperature=0.0), 2, lambda k, o: greedy.append((k, o)))
    assert [p.n for p in engine.params[1:]] == [1, 1] and len(greedy) == 2  # vLLM refuses n > 1 greedy

    engine.respond = lambda ids, params, eng: {**echo(ids, params, eng), "seconds": 30.0}
    group = asyncio.create_task(backend.generate_group(request, 2, lambda k, out: reported.append((k, out))))
    await eventually(lambda: backend.running == 1, "the group's request is in flight")
    group.cancel()
    with pytest.raises(asyncio.CancelledError):
        await group
    await eventually(lambda: [c for c in engine.calls if c[0] == "abort"], "the request is aborted")
    assert backend.running == 0 and len(reported) == 3
    await backend.close()


async def test_weight_update_follows_the_async_rl_sequence(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rewardmesh.server.rollout.backends.vllm_updates.CHUNK_BYTES", 16 * 1024)
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None
    engine.calls.clear()
    new = perturbed(state_dict(tiny_models.policy))
    await backend.update_weights(new, version=7)
    names = [c[0] for c in engine.calls]
    stages = names.count("rewardmesh_stage_weights")
    assert stages > 3  # streamed in many small chunks
    assert names == ["rewardmesh_stage_weights"] * stages + ["rewardmesh_check_weights",
        "pause_generation", "rewardmesh_commit_weights", "update_weight_version", "resume_generation"
    ]  # fmt: skip
    assert engine.calls[stages + 1] == ("pause_generation", "keep", True)
    assert engine.calls[stages + 3] == ("update_weight_version", "7")
    assert backend.policy_version == 7
    assert all(torch.equal(engine.model.state[k], new[k]) for k in new if k != "lm_head.weight")
    assert engine.worker.model_runner.reloads == 1  # through the runner's in-place reload, in one call
    out = await backend.generate(GenerationRequest([1, 2], max_tokens=3))
    assert out.token_versions == [7, 7, 7] and out.policy_version == 7


async def test_a_failed_commit_keeps_the_old_version_and_resumes(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rewardmesh.server.rollout.backends.vllm_updates.CHUNK_BYTES", 16 * 1024)
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None
    engine.model.fail_after = 0
    with pytest.raises(RuntimeError, match="simulated failure"):
        await backend.update_weights(perturbed(state_dict(tiny_models.policy)), version=2)
    assert backend.policy_version == 0 and engine.label == "0" and not engine.paused
    assert [c[0] for c in engine.calls][-2:] == ["rewardmesh_commit_weights", "resume_generation"]
    # a stage that fails half-way discards what was staged and never pauses the engine
    engine.calls.clear()
    engine.model.fail_after = None

    async def failing_rpc(method: str, args: tuple[Any, ...] = ()) -> Any:
        engine.calls.append((method,))
        if method == "rewardmesh_stage_weights" and len(engine.calls) > 1:
            raise RuntimeError("connection lost")
        return getattr(engine.worker, method)(*args)

    engine.collective_rpc = failing_rpc  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="connection lost"):
        await backend.update_weights(state_dict(tiny_models.policy), version=3)
    assert [c[0] for c in engine.calls][-1] == "rewardmesh_discard_weights"
    assert "pause_generation" not in [c[0] for c in engine.calls] and backend.policy_version == 0
    await backend.close()


async def test_a_chunk_lost_on_the_way_is_refused_before_loading_and_the_old_weights_serve_on(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    """The workers' check refuses an incomplete staged set (WeightsNotApplied: INVALID_ARGUMENT) before the engine
    pauses or loads anything; the backend is not marked torn and keeps serving the old version."""
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None
    delivered = engine.collective_rpc
    before = {k: v.clone() for k, v in engine.model.state.items()}

    async def losing_rpc(method: str, args: tuple[Any, ...] = ()) -> Any:
        if method == "rewardmesh_stage_weights":  # the chunk never reaches the worker
            engine.calls.append((method,))
            return [0]
        return await delivered(method, args)

    engine.collective_rpc = losing_rpc  # type: ignore[method-assign]
    with pytest.raises(WeightsNotApplied, match="staged weights incomplete"):
        await backend.update_weights(perturbed(state_dict(tiny_models.policy)), version=2)
    names = [c[0] for c in engine.calls]
    assert "rewardmesh_check_weights" in names and names[-1] == "rewardmesh_discard_weights"
    assert "pause_generation" not in names and "rewardmesh_commit_weights" not in names and engine.model.loads == []
    assert backend.unusable is None and backend.policy_version == 0
    assert all(torch.equal(engine.model.state[k], v) for k, v in before.items())
    out = await backend.generate(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=3))
    assert len(out.token_ids) == 3 and out.policy_version == 0
    await backend.close()


async def test_a_load_that_fails_part_way_stops_serving_until_a_full_update(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    """Half the tensors loaded: the server refuses Generate (UNAVAILABLE: the trainer asks another server)
    rather than label a mix of two versions as either; the next update of every tensor restores it."""
    backend = VLLMBackend(str(tiny_models.policy))
    server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=0, grace_s=0.5))
    await server.start()
    engine = fake_vllm.last
    assert engine is not None
    state = state_dict(tiny_models.policy)
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(group_id="g", token_ids=ids_tensor([5, 6, 7]))],
        n=2,
        sampling=rollout_pb2.SamplingParams(max_tokens=3),
    )
    try:
        async with aio.insecure_channel(server.address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            engine.model.fail_after = 3
            with pytest.raises(RuntimeError, match="simulated failure"):
                await backend.update_weights(perturbed(state), version=2)
            assert backend.policy_version == 0 and backend.unusable and "version 2" in backend.unusable
            with pytest.raises(aio.AioRpcError) as err:
                _ = [r async for r in stub.Generate(request, timeout=10)]
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "part-way" in (err.value.details() or "")

            engine.model.fail_after = None
            await backend.update_weights({k: v for k, v in perturbed(state).items() if "mlp" in k}, version=3)
            assert backend.unusable  # a partial update does not cover what the torn one may have changed
            await backend.update_weights(perturbed(state, 0.1), version=4)
            assert backend.unusable is None
            responses = [r async for r in stub.Generate(request, timeout=10)]
            samples = [item for r in responses for item in (r.items or [r])]
            assert len(samples) == 2 and all(s.sample.policy_version == 4 for s in samples)
    finally:
        await server.stop(0)


async def test_a_pause_that_fails_discards_the_staged_weights(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None

    async def broken_pause(**kwargs: Any) -> None:
        raise RuntimeError("engine core died")

    engine.pause_generation = broken_pause  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine core died"):
        await backend.update_weights(perturbed(state_dict(tiny_models.policy)), version=1)
    names = [c[0] for c in engine.calls]
    assert names[-1] == "rewardmesh_discard_weights" and "rewardmesh_commit_weights" not in names
    assert not engine.worker.__dict__.get("_rewardmesh_staged") and backend.policy_version == 0
    assert backend.unusable is None  # nothing was loaded: the old weights serve on
    await backend.close()


async def test_quantized_models_refuse_in_place_updates(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    backend = VLLMBackend(str(tiny_models.policy), engine_args={"quantization": "fp8"})
    await backend.start()
    with pytest.raises(WeightsError, match=r"quantized \(fp8\)"):
        await backend.update_weights(state_dict(tiny_models.policy), version=1)
    assert fake_vllm.last is not None and not [c for c in fake_vllm.last.calls if c[0].startswith("rewardmesh")]
    await backend.close()


# ----------------------------------------------------------------------------------- vLLM itself (CPU or GPU)
# vLLM's CPU build (`make test-vllm`) or a GPU with vLLM: one engine, booted once behind a real rollout server,
# serves every test below. REWARDMESH_ENGINE_ARG (KEY=VALUE,...) adds engine arguments as it does for
# `rewardmesh serve rollout`, e.g. attention_backend=TRITON_ATTN for a vLLM build without flash-attention.


def per_request_preemptions() -> bool:
    """vLLM reports preemptions per request (RequestOutput.metrics.num_preemptions) from 0.33 on."""
    from vllm.v1.metrics.stats import RequestStateStats

    return "num_preemptions" in {f.name for f in dataclasses.fields(RequestStateStats)}


@pytest.fixture(scope="module")
def vllm_policy(tiny_models: TinyModelPaths) -> Path:
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build takes several by default
    return tiny_models.policy


@dataclasses.dataclass
class Served:
    server: RolloutServer
    backend: VLLMBackend
    # RolloutService's health status, polled while the engine booted, and whether the engine was up when it came
    boot_health: list[tuple[int, bool]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(vllm_policy: Path) -> AsyncIterator[Served]:
    backend = VLLMBackend(str(vllm_policy), gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=512,
                          engine_args={"max_logprobs": 3, **engine_args_from_env()})  # fmt: skip
    server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=0, grace_s=0.5))
    await server.start(wait_ready=False)
    seen: list[tuple[int, bool]] = []
    try:
        async with aio.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while not backend.ready:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=ROLLOUT_SERVICE), timeout=5)
                seen.append((int(reply.status), backend.ready))
                await asyncio.sleep(0.2)
            await server.ready()
            reply = await health.Check(health_pb2.HealthCheckRequest(service=ROLLOUT_SERVICE), timeout=5)
            seen.append((int(reply.status), backend.ready))
        yield Served(server, backend, seen)
    finally:
        await server.stop(0)


@pytest.fixture
def engine(served: Served) -> VLLMBackend:
    return served.backend


def greedy(prompt: list[int], max_tokens: int = 16, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, **kw)


def prompts(engine: VLLMBackend) -> list[list[int]]:
    texts = ["What is 2 + 2?", "Tell me a short story about a cat.", "7 + 8 =", "Add 9 and 9."]
    return [list(engine.tokenizer.encode(t)) for t in texts]


async def greedy_outputs(engine: VLLMBackend) -> list[list[int]]:
    return [o.token_ids for o in await asyncio.gather(*(engine.generate(greedy(p)) for p in prompts(engine)))]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_rollout_server_is_not_serving_until_the_engine_has_booted(served: Served) -> None:
    not_serving, serving = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    # A reply that came while the engine was still down said so; one that came as it came up may say either.
    while_down = [status for status, up in served.boot_health if not up]
    assert while_down and set(while_down) == {not_serving}, served.boot_health
    assert served.boot_health[-1] == (serving, True)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_engine_gets_offline_scheduler_limits_engine_args_and_no_stats_logging(
    engine: VLLMBackend, vllm_policy: Path
) -> None:
    """The scheduler limits a user of offline ``LLM`` gets on this machine, unless set; stats logging off."""
    from vllm import AsyncEngineArgs

    from rewardmesh.server.rollout.backends.vllm_engine import llm_usage_context

    core: Any = engine._engine
    offline = AsyncEngineArgs(model=str(vllm_policy), max_model_len=512, enforce_eager=True,
                              **engine_args_from_env()).create_engine_config(llm_usage_context())  # fmt: skip
    mine = core.vllm_config.scheduler_config
    want = offline.scheduler_config
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (want.max_num_seqs, want.max_num_batched_tokens)
    assert core.model_config.max_logprobs == 3  # an engine argument reaches the engine
    assert not core.log_stats
    assert mine.stream_interval == STREAM_INTERVAL  # a group's samples: two outputs each, not one per token


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_generates_deterministically(engine: VLLMBackend) -> None:
    counted = per_request_preemptions() and engine._engine.log_stats  # vLLM counts them only with stats on
    ps = prompts(engine)
    first = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    second = await asyncio.gather(*(engine.generate(greedy(p)) for p in ps))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    for out in first:
        assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 16
        assert out.finish_reason == "stop" or len(out.token_ids) == 16
        assert out.policy_version == engine.policy_version
        assert out.num_preempted >= 0 if counted else out.num_preempted == -1
    seeded = GenerationRequest(ps[1], max_tokens=24, temperature=1.0, seed=7)
    assert (await engine.generate(seeded)).token_ids == (await engine.generate(seeded)).token_ids
    assert engine.running == 0


@contextlib.contextmanager
def engine_requests(engine: VLLMBackend) -> Iterator[list[int]]:
    """The `n` of every request that reaches vLLM's engine while the block runs (the engine itself, observed)."""
    core: Any = engine._engine
    seen: list[int] = []
    real = core.generate

    def observed(prompt: Any, params: Any, request_id: str, **kw: Any) -> Any:
        seen.append(params.n)
        return real(prompt, params, request_id, **kw)

    core.generate = observed
    try:
        yield seen
    finally:
        del core.generate  # the instance attribute goes; the class's method serves again


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_a_group_is_one_request_and_equals_its_samples_drawn_one_by_one(engine: VLLMBackend) -> None:
    """vLLM gives sample k of an n > 1 request the seed `seed + k`: the same tokens, log-probs and per-token
    versions as n requests with those seeds; samples that end early are reported before the group ends."""
    reported: list[tuple[int, GenerationOutput | Exception]] = []

    def on_sample(k: int, out: GenerationOutput | Exception) -> None:
        reported.append((k, out))

    for i, p in enumerate(prompts(engine)):
        seed = 11 + i
        request = GenerationRequest(p, 40, temperature=1.0, top_k=50, seed=seed, logprobs=True)
        reported.clear()
        with engine_requests(engine) as seen:
            await engine.generate_group(request, 4, on_sample)
        grouped = {k: out for k, out in reported if isinstance(out, GenerationOutput)}
        order = [k for k, _ in reported]
        assert seen == [4] and sorted(order) == [0, 1, 2, 3]
        with engine_requests(engine) as seen:
            alone = await asyncio.gather(
                *(engine.generate(dataclasses.replace(request, seed=seed + k)) for k in range(4))
            )
        assert seen == [1, 1, 1, 1]
        for k, out in enumerate(alone):
            got = grouped[k]
            assert got.token_ids == out.token_ids and got.finish_reason == out.finish_reason
            assert got.logprobs == out.logprobs and got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
            assert got.token_versions == out.token_versions == [engine.policy_version] * len(got.token_ids)
        lengths = [len(grouped[k].token_ids) for k in order]
        assert lengths == sorted(lengths)  # a shorter sample is never reported after a longer one
    assert engine.running == 0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_server_groups_single_turn_samples_and_runs_tool_samples_one_by_one(served: Served) -> None:
    """Through Generate: without tools a prompt's n samples are one engine request; with tools (the agent loop
    may take several turns) each is its own. Both give the same samples for the same seed."""
    engine = served.backend
    ps = prompts(engine)

    async def generate(tools: list[str]) -> dict[str, Any]:
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(group_id=f"p{i}", token_ids=ids_tensor(p)) for i, p in enumerate(ps)],
            n=4,
            sampling=rollout_pb2.SamplingParams(max_tokens=24, temperature=1.0, seed=5, logprobs=True),
            agent=rollout_pb2.AgentLoopConfig(max_turns=3, tools=tools),
        )
        async with aio.insecure_channel(served.server.address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            answers = [r async for r in stub.Generate(request, timeout=120)]
        assert all(not a.result.HasField("error") for a in answers)
        return {a.sample.sample_id: a.sample for a in answers}

    with engine_requests(engine) as grouped_requests:
        grouped = await generate([])
    with engine_requests(engine) as tool_requests:
        one_by_one = await generate(["calculator"])
    assert grouped_requests == [4] * len(ps)
    assert tool_requests == [1] * (4 * len(ps))  # the model called no tool: one turn each
    assert sorted(grouped) == sorted(one_by_one) == sorted(f"p{i}/{k}" for i in range(len(ps)) for k in range(4))
    for sid, sample in grouped.items():
        other = one_by_one[sid]
        for field in ("response_ids", "response_mask", "response_logprobs", "response_policy_versions"):
            assert getattr(sample, field) == getattr(other, field), (sid, field)
        assert (sample.finish_reason, sample.policy_version) == (other.finish_reason, other.policy_version)
        assert sample.timing.num_turns == other.timing.num_turns == 1


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_each_sample_of_a_group_is_scored_as_it_finishes_not_when_its_group_does(
    engine: VLLMBackend,
) -> None:
    """Sample 0 stops after a few tokens, sample 1 runs 480: sample 0 comes back scored by a real reward server
    while the group's engine request is still generating sample 1."""
    p = prompts(engine)[1]
    for seed in range(40):  # a seed whose sample 0 draws, early on, a token that sample 1 never draws
        long = GenerationRequest(p, 480, temperature=1.0, seed=seed, ignore_eos=True)
        first, second = await asyncio.gather(
            engine.generate(long), engine.generate(dataclasses.replace(long, seed=seed + 1))
        )
        stop = next((t for t in first.token_ids[:4] if t not in second.token_ids), None)
        if stop is not None:
            break
    else:
        pytest.fail("no seed gave sample 0 an early token that sample 1 never draws")
    prompt = PromptInput(rollout_pb2.Prompt(group_id="g"), "g", p, ids_tensor(p), "")
    jobs = [Job("g/0", prompt, seed), Job("g/1", prompt, seed + 1)]
    settings = RunSettings(dataclasses.replace(long, prompt_ids=[], stop_token_ids=[stop], seed=None),
                           AgentSettings(), reward="noop", reward_timeout=None)  # fmt: skip
    async with reward_server() as reward, RewardClient([reward.address]) as rewards:
        worker = RolloutWorker(engine, rewards)
        with engine_requests(engine) as seen:
            short, rest = worker.start(jobs, settings)
            scored = await short
            running_then = engine.running
            last = await rest
    assert seen == [2]
    assert scored.sample.response_ids.shape == [first.token_ids.index(stop) + 1]
    assert not scored.result.HasField("error") and scored.result.sample_id == "g/0" and scored.sample.timing.reward > 0
    assert running_then == 1  # the group's request was still generating sample 1
    assert last.sample.response_ids.shape == [480] and not last.result.HasField("error")


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_honours_stop_tokens_and_strings(engine: VLLMBackend) -> None:
    tok: Any = engine.tokenizer
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


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_min_tokens_holds_back_stop_tokens_and_ignore_eos_runs_to_max_tokens(engine: VLLMBackend) -> None:
    request = GenerationRequest(prompts(engine)[2], max_tokens=30, temperature=1.0, seed=5)
    tokens = (await engine.generate(request)).token_ids
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), None)
    if k is None or k > 20:
        pytest.skip("no fresh token early in this sample")
    request.stop_token_ids = [tokens[k]]
    assert (await engine.generate(request)).token_ids == tokens[: k + 1]
    request.min_tokens = k + 6
    held = await engine.generate(request)
    assert len(held.token_ids) >= k + 6 and tokens[k] not in held.token_ids[: k + 5]
    runs = await engine.generate(greedy(prompts(engine)[2], max_tokens=40, ignore_eos=True, min_tokens=3))
    assert runs.finish_reason == "length" and len(runs.token_ids) == 40


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_cancellation_aborts(engine: VLLMBackend) -> None:
    task = asyncio.create_task(engine.generate(greedy(prompts(engine)[3], max_tokens=480, ignore_eos=True)))
    deadline = time.monotonic() + 120  # the first step of a long request; a loaded host takes its time
    while engine.running == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert engine.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.running == 0
    # the engine keeps serving
    assert (await engine.generate(greedy(prompts(engine)[0], max_tokens=4))).token_ids


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_update_weights(engine: VLLMBackend, vllm_policy: Path) -> None:
    before = await greedy_outputs(engine)
    original = state_dict(vllm_policy)
    version = engine.policy_version

    with pytest.raises(WeightsError, match=r"model\.norm\.weight"):
        await engine.update_weights({**original, "model.norm.weight": torch.zeros(3)}, version=99)
    assert engine.policy_version == version
    assert await greedy_outputs(engine) == before

    await engine.update_weights(perturbed(original), version=version + 1)
    after = await asyncio.gather(*(engine.generate(greedy(p)) for p in prompts(engine)))
    assert engine.policy_version == version + 1 and all(o.policy_version == version + 1 for o in after)
    assert [o.token_ids for o in after] != before

    await engine.update_weights(original, version=version + 2)  # the layerwise reload takes a second update
    assert await greedy_outputs(engine) == before


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_an_incomplete_staged_update_applies_nothing(engine: VLLMBackend, vllm_policy: Path) -> None:
    """The worker checks the staged set before loading: a missing tensor fails the commit with nothing applied,
    the server keeps serving the old weights (not marked torn), and the next whole update works."""
    before = await greedy_outputs(engine)
    version = engine.policy_version
    core: Any = engine._engine
    state = perturbed(state_dict(vllm_policy))
    names = [n for n in state if n != "lm_head.weight"]
    for chunk in iter_chunks({n: state[n] for n in names[:-1]}, chunk_bytes=64 << 10):
        await core.collective_rpc("rewardmesh_stage_weights", args=(chunk,))
    with pytest.raises(Exception, match="nothing applied"):
        await core.collective_rpc("rewardmesh_commit_weights", args=(names,))
    assert await greedy_outputs(engine) == before and engine.unusable is None and engine.policy_version == version
    await engine.update_weights(state, version=version + 1)
    assert await greedy_outputs(engine) != before
    await engine.update_weights(state_dict(vllm_policy), version=version + 2)
    assert await greedy_outputs(engine) == before


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_logprobs_and_token_versions_match_a_separate_forward_pass(
    engine: VLLMBackend, vllm_policy: Path
) -> None:
    """After an update of every weight (the tied output head included, which vLLM never loads by name)."""
    lm = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    state = perturbed(state_dict(vllm_policy), 0.05)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    lm.load_state_dict(state)
    await engine.update_weights(state, version=engine.policy_version + 1)
    try:
        for temperature, top_k in ((1.0, 0), (0.7, 20)):
            for p in prompts(engine):
                request = GenerationRequest(p, 24, temperature=temperature, top_k=top_k, seed=3, logprobs=True)
                out = await engine.generate(request)
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                with torch.inference_mode():
                    logits = lm(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1 : -1].float() / temperature
                if top_k:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                want = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
                # The engine computes in half precision (bf16 on CPU): close, not equal; a token at the top-k
                # boundary may be in the engine's top k and just outside float32's.
                kept = want.isfinite()
                assert int(kept.sum()) >= len(out.token_ids) - 1
                torch.testing.assert_close(torch.tensor(out.logprobs)[kept], want[kept], atol=0.1, rtol=0.05)
                assert out.token_versions == [engine.policy_version] * len(out.token_ids)
    finally:
        await engine.update_weights(state_dict(vllm_policy), version=engine.policy_version + 1)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_weight_specs(engine: VLLMBackend, vllm_policy: Path) -> None:
    specs = engine.weight_specs()
    state = state_dict(vllm_policy)
    assert set(specs) == set(state)
    assert all(specs[n][0] == tuple(t.shape) for n, t in state.items())
    assert {dtype for _, dtype in specs.values()} <= {torch.bfloat16, torch.float16, torch.float32}


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("transport", ["grpc", "shm", "dist"])
async def test_vllm_weight_transports_change_greedy_output(served: Served, vllm_policy: Path, transport: str) -> None:
    """A trainer's update over each data plane (dist: gloo on CPU, NCCL on a GPU) reaches vLLM: greedy output
    changes with the weights and comes back with the checkpoint's."""
    engine = served.backend
    before = await greedy_outputs(engine)
    original = state_dict(vllm_policy)
    async with TrainerClient([served.server.address]) as client:
        client.policy_version = engine.policy_version
        version = await client.update_weights(perturbed(original, 0.3), transport=transport)
        assert client.last_weight_sync is not None and client.last_weight_sync.transport == transport
        assert engine.policy_version == version and await greedy_outputs(engine) != before
        request = [PromptSpec(token_ids=p) for p in prompts(engine)]
        batch = await client.generate_batch(request, n=2, sampling=Sampling(temperature=0.0, max_tokens=8))
        assert {s.policy_version for s in batch.samples} == {version}
        await client.update_weights(original, transport=transport)
    assert await greedy_outputs(engine) == before


def test_tokenizer_is_the_policy_tokenizer(tiny_models: TinyModelPaths) -> None:
    backend = VLLMBackend(str(tiny_models.policy))
    reference = AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)
    assert backend.tokenizer.get_vocab() == reference.get_vocab()


async def test_rollout_server_is_not_serving_until_the_engine_has_booted(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    fake_vllm.boot_seconds = 0.5
    backend = VLLMBackend(str(tiny_models.policy))
    server = RolloutServer(backend, None, ServerOptions(host="127.0.0.1", port=0, grace_s=0.5))
    await server.start(wait_ready=False)
    try:
        async with aio.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                return int(reply.status)

            assert await status(ROLLOUT_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status("") == health_pb2.HealthCheckResponse.SERVING  # alive: a liveness probe passes
            await server.ready()
            assert await status(ROLLOUT_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_engine_options_come_from_flags_environment_and_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        ["serve", "rollout", "--backend", "vllm", "--gpu-memory-utilization", "0.4", "--tensor-parallel-size", "2",
         "--enforce-eager", "--engine-arg", "max_num_seqs=16", "--engine-arg", "attention_backend=TRITON_ATTN"]
    )  # fmt: skip
    cfg = resolve(RolloutServerConfig, args, {})
    options = backend_options(cfg)
    assert options["gpu_memory_utilization"] == 0.4 and options["tensor_parallel_size"] == 2
    assert options["enforce_eager"] is True
    assert options["engine_args"] == {"max_num_seqs": 16, "attention_backend": "TRITON_ATTN"}

    bare = build_parser().parse_args(["serve", "rollout", "--backend", "vllm"])
    monkeypatch.setenv("REWARDMESH_ENGINE_ARG", "attention_backend=TRITON_ATTN,max_num_seqs=8")
    assert backend_options(resolve(RolloutServerConfig, bare, {}))["engine_args"] == {
        "attention_backend": "TRITON_ATTN",
        "max_num_seqs": 8,
    }
    monkeypatch.delenv("REWARDMESH_ENGINE_ARG")
    from_yaml = resolve(
        RolloutServerConfig, bare, {"engine_arg": {"max_num_seqs": 4, "compilation_config": {"level": 0}}}
    )
    assert backend_options(from_yaml)["engine_args"] == {"max_num_seqs": 4, "compilation_config": {"level": 0}}

    hf = resolve(RolloutServerConfig, build_parser().parse_args(["serve", "rollout", "--max-batch-tokens", "4096"]), {})
    assert backend_options(hf)["max_batch_tokens"] == 4096 and backend_options(hf)["num_threads"] is None
    with pytest.raises(ValueError, match="engine_arg"):
        backend_options(
            resolve(RolloutServerConfig, build_parser().parse_args(["serve", "rollout", "--engine-arg", "a=1"]), {})
        )


def ipc_source(state: dict[str, torch.Tensor], memory: dict[bytes, torch.Tensor]) -> Any:
    """Handles as the trainer's `cuda_ipc.handles` writes them, for tensors the stand-in engine can look up."""
    source = rollout_pb2.CudaIpcSource(device_uuid="GPU-test")
    for i, t in enumerate(state.values()):
        key = f"storage-{i}".encode()
        memory[key] = t.flatten()
        source.handles.add(storage_handle=key, storage_size_bytes=t.numel() * t.element_size(), stride=list(t.stride()),
                           ref_counter_handle=b"ref", event_handle=b"event")  # fmt: skip
    return source


async def test_cuda_ipc_updates_go_through_vllms_weight_transfer_engine(
    tiny_models: TinyModelPaths, fake_vllm: type[FakeEngine]
) -> None:
    """The engine is built with vLLM's "ipc" weight transfer; an update is init (once), pause, start, update
    (handles as torch's rebuild arguments, pickled by the server itself), finish, label, resume; a load that
    fails part-way leaves the server refusing work, and resumes generation all the same."""
    from rewardmesh.common.planes.cuda_ipc import check_source
    from rewardmesh.common.planes.manifest import Entry

    backend = VLLMBackend(str(tiny_models.policy))
    await backend.start()
    engine = fake_vllm.last
    assert engine is not None and engine.args.weight_transfer_config.backend == "ipc"
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    sequence = ["pause_generation", "start_weight_update", "update_weights", "finish_weight_update",
                "update_weight_version", "resume_generation"]  # fmt: skip
    for version in (5, 6):
        engine.calls.clear()
        new = perturbed(state_dict(tiny_models.policy), scale=0.1 * version)
        entries = [Entry(n, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for n, t in new.items()]
        source = ipc_source(new, engine.ipc_memory)
        check_source(source, entries, "GPU-test")  # what the receiver checks first
        await backend.update_weights_ipc(entries, source, version)
        first: list[tuple[Any, ...]] = [("init_weight_transfer_engine", {})] if version == 5 else []  # once
        assert engine.calls[: len(first)] == first and engine.calls[len(first)] == ("pause_generation", "keep", True)
        assert [c[0] for c in engine.calls[len(first) :]] == sequence
        assert backend.policy_version == version
        assert all(torch.equal(engine.model.state[k], new[k]) for k in new if k != "lm_head.weight")
        assert "lm_head.weight" not in engine.model.loads[-1]  # tied to the embeddings: vLLM ignores it
    engine.model.fail_after = 2
    engine.calls.clear()
    with pytest.raises(RuntimeError, match="simulated failure"):
        await backend.update_weights_ipc(entries, source, 7)
    assert backend.policy_version == 6 and backend.unusable and engine.calls[-1] == ("resume_generation",)
    await backend.close()


# --------------------------------------------------------------------------- `rewardmesh serve rollout --backend vllm`

CLI = [sys.executable, "-m", "rewardmesh.server.cli"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_vllm_serve_rollout_cli_scores_samples_and_takes_weight_updates(
    vllm_policy: Path, tmp_path: Path
) -> None:
    """The process a user starts: `rewardmesh serve rollout --backend vllm` streaming to a reward server, driven by
    TrainerClient; every sample is scored, and a weight update changes the greedy output."""
    extra = [f"--engine-arg={a}" for a in os.environ.get("REWARDMESH_ENGINE_ARG", "").split(",") if a]
    async with reward_server() as reward:
        rollout = ServerProcess("rollout", [*CLI, "serve", "rollout", "--backend", "vllm", "--model", str(vllm_policy),
                                            "--host", "127.0.0.1", "--port", "0", "--reward-target", reward.address,
                                            "--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization",
                                            "0.25", "--engine-arg", "max_num_seqs=64", *extra], tmp_path)  # fmt: skip
        try:
            rollout.start(timeout_s=120)
            await rollout.wait_serving(ROLLOUT_SERVICE, timeout_s=480)
            tok: Any = AutoTokenizer.from_pretrained(vllm_policy)
            specs = [PromptSpec(token_ids=tok.encode(f"{a} + {b} ="), ground_truth=str(a + b), data_source="demo")
                     for a, b in ((1, 2), (3, 4), (2, 5), (4, 4))]  # fmt: skip
            async with TrainerClient([rollout.address], reward="first_number") as client:
                batch = await client.generate_batch(specs, n=4, sampling=Sampling(max_tokens=8, temperature=1.0))
                assert len(batch.samples) == 16 and not [s.error for s in batch.samples if s.error]
                assert all(s.score in (0.0, 0.1, 1.0) and "acc" in s.extras for s in batch.samples)
                greedy_run = Sampling(max_tokens=12, temperature=0.0)
                before = [
                    s.response_ids.tolist() for s in (await client.generate_batch(specs, sampling=greedy_run)).samples
                ]
                assert await client.update_weights(perturbed(state_dict(vllm_policy), 0.3), transport="grpc") == 1
                after = await client.generate_batch(specs, sampling=greedy_run)
                assert {s.policy_version for s in after.samples} == {1}
                assert sorted(s.response_ids.tolist() for s in after.samples) != sorted(before)
                assert [i.policy_version for i in await client.info()] == [1]
        finally:
            assert rollout.stop(timeout_s=120) == 0, rollout.log_tail()
