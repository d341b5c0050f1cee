"""ModelSource against real tiny reward models: padding, batching, re-tokenization, per-sample failures."""

from __future__ import annotations

import asyncio
import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rewardmesh.common.errors import InvalidInput, SourceFailed, Unavailable
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.reward_engine.sources.reward_model import ModelSource, length_buckets
from rewardmesh.reward_engine.types import RewardInput, RewardOutput

TOL = 1e-4
PAIRS = [
    ("What is 3 + 4?", "7"),
    ("What is 3 + 4?", "The answer is 8."),
    ("Add 9 and 9.", "18"),
    ("Compute 123 + 4567 and explain every step of the addition carefully, digit by digit.", "4690"),
    ("Tell me a short story about a cat who reads a book.", "The cat reads a book with care. The end!"),
    ("1+1=", "2"),
]


@pytest.fixture(scope="module")
def policy_tok(tiny_models: TinyModelPaths) -> Any:
    return AutoTokenizer.from_pretrained(tiny_models.policy, local_files_only=True)


@pytest.fixture(scope="module")
def other_tok(tiny_models: TinyModelPaths) -> Any:
    return AutoTokenizer.from_pretrained(tiny_models.reward_model_other_tokenizer, local_files_only=True)


def source(name: str, path: Path, **options: Any) -> ModelSource:
    """A source on CPU in fp32 even where CUDA exists, so the tight tolerances below hold everywhere."""
    options.setdefault("device", "cpu")
    return ModelSource(name, str(path), **options)


@pytest.fixture(scope="module")
def rm(tiny_models: TinyModelPaths) -> ModelSource:
    return source("rm", tiny_models.reward_model)


@pytest.fixture(scope="module")
def rm_other(tiny_models: TinyModelPaths) -> ModelSource:
    return source("rm-other", tiny_models.reward_model_other_tokenizer, policy_tokenizer=str(tiny_models.policy))


def sample(tok: Any, prompt: str, response: str, *, with_text: bool = True, sid: str = "s") -> RewardInput:
    """A sample as the trainer sends it: the policy's templated prompt ids and the response ids."""
    templated = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return RewardInput(
        sample_id=sid,
        prompt_ids=np.asarray(tok.encode(templated), dtype=np.int32),
        response_ids=np.asarray(tok.encode(response + "<|im_end|>"), dtype=np.int32),
        prompt_text=prompt if with_text else "",
        response_text=response if with_text else "",
    )


def scores(results: list[RewardOutput | BaseException]) -> list[float]:
    out = []
    for r in results:
        assert isinstance(r, RewardOutput), r
        out.append(r.score)
    return out


def ids_of(s: RewardInput) -> np.ndarray:
    return np.concatenate([s.prompt_ids, s.response_ids])


def rendered(tok: Any, prompt: str, response: str) -> list[int]:
    conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    ids: list[int] = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
    return ids


def test_attributes_and_auto_device(tiny_models: TinyModelPaths) -> None:
    auto = ModelSource("rm", str(tiny_models.reward_model))
    assert (auto.name, auto.kind, auto.target) == ("rm", "model", str(tiny_models.reward_model))
    assert auto.max_length == 4096
    assert auto.retokenizes is False
    if torch.cuda.is_available():
        assert auto.device.type == "cuda"
        assert auto.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    else:
        assert auto.device == torch.device("cpu")
        assert auto.dtype == torch.float32
    model = auto._model
    assert model is not None
    param = next(model.parameters())
    assert (param.device.type, param.dtype) == (auto.device.type, auto.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_scores_match_cpu(rm: ModelSource, tiny_models: TinyModelPaths, policy_tok: Any) -> None:
    gpu = ModelSource("rm-gpu", str(tiny_models.reward_model), device="cuda")
    await gpu.warmup()
    batch = [sample(policy_tok, p, r, sid=str(i)) for i, (p, r) in enumerate(PAIRS)]
    on_gpu = scores(await gpu.score_batch(batch))
    alone = [scores(await gpu.score_batch([s]))[0] for s in batch]
    on_cpu = scores(await rm.score_batch(batch))
    for g, a, c in zip(on_gpu, alone, on_cpu, strict=True):
        tol = 0.1 * max(1.0, abs(c))
        assert g == pytest.approx(c, abs=tol) and a == pytest.approx(g, abs=tol)


async def test_scores_are_finite_and_differ(rm: ModelSource, policy_tok: Any) -> None:
    batch = [sample(policy_tok, p, r, sid=str(i)) for i, (p, r) in enumerate(PAIRS)]
    got = scores(await rm.score_batch(batch))
    assert len(got) == len(PAIRS)
    assert all(isinstance(s, float) and math.isfinite(s) for s in got)
    # random weights with a wide init: distinct inputs get clearly distinct scores, so equality tests bite
    assert min(abs(a - b) for i, a in enumerate(got) for b in got[i + 1 :]) > 100 * TOL


async def test_padding_does_not_change_a_score(rm: ModelSource, policy_tok: Any) -> None:
    short = sample(policy_tok, "1+1=", "2")
    longer = [sample(policy_tok, p, r) for p, r in PAIRS[3:5]]
    assert all(s.num_tokens > short.num_tokens + 10 for s in longer)
    (alone,) = scores(await rm.score_batch([short]))
    in_batch = scores(await rm.score_batch([longer[0], short, longer[1]]))[1]
    assert in_batch == pytest.approx(alone, abs=TOL)

    # what a wrong implementation would read: the last position of the padded row
    pad = np.full(longer[0].num_tokens - short.num_tokens, rm.pad_token_id)
    (at_padded_end,) = rm.score_tokens([np.concatenate([ids_of(short), pad])])
    assert abs(at_padded_end - alone) > 100 * TOL


async def test_a_sequence_ending_in_the_pad_token_is_scored_at_its_end(rm: ModelSource, policy_tok: Any) -> None:
    # <|endoftext|> is both a real token a policy may emit and the pad id: the length, not the id, marks the end
    s = sample(policy_tok, "What is 3 + 4?", "7")
    s.response_ids = np.append(s.response_ids, np.int32(policy_tok.pad_token_id))
    (alone,) = scores(await rm.score_batch([s]))
    (without_it,) = rm.score_tokens([ids_of(s)[:-1]])
    assert abs(alone - without_it) > 100 * TOL
    batched = scores(await rm.score_batch([s, sample(policy_tok, *PAIRS[4])]))[0]
    assert batched == pytest.approx(alone, abs=TOL)


async def test_batch_equals_one_by_one(rm: ModelSource, policy_tok: Any) -> None:
    batch = [sample(policy_tok, p, r, sid=str(i)) for i, (p, r) in enumerate(PAIRS)]
    together = scores(await rm.score_batch(batch))
    alone = [scores(await rm.score_batch([s]))[0] for s in batch]
    assert together == pytest.approx(alone, abs=TOL)
    assert rm.score_tokens([ids_of(s) for s in batch]) == pytest.approx(alone, abs=TOL)


async def test_same_tokenizer_scores_the_ids_not_the_text(
    rm: ModelSource, policy_tok: Any, tiny_models: TinyModelPaths
) -> None:
    s = sample(policy_tok, "What is 3 + 4?", "7")
    s.prompt_text, s.response_text = "Tell me a short story.", "Once upon a time"  # deliberately inconsistent
    (got,) = scores(await rm.score_batch([s]))
    (expected,) = rm.score_tokens([ids_of(s)])
    (from_text,) = rm.score_tokens([rendered(policy_tok, s.prompt_text, s.response_text)])
    assert got == pytest.approx(expected, abs=TOL)
    assert abs(got - from_text) > 100 * TOL

    # "auto" with the policy's own tokenizer also scores ids directly; "always" forces re-tokenization
    auto = source("rm-auto", tiny_models.reward_model, policy_tokenizer=str(tiny_models.policy))
    assert auto.retokenizes is False
    assert scores(await auto.score_batch([s]))[0] == pytest.approx(expected, abs=TOL)
    always = source("rm-always", tiny_models.reward_model, retokenize="always")
    assert always.retokenizes is True
    assert scores(await always.score_batch([s]))[0] == pytest.approx(from_text, abs=TOL)


async def test_other_tokenizer_retokenizes_with_its_chat_template(
    rm_other: ModelSource, policy_tok: Any, other_tok: Any
) -> None:
    assert rm_other.retokenizes is True
    prompt, response = "Add 9 and 9.", "18"
    s = sample(policy_tok, prompt, response)
    (got,) = scores(await rm_other.score_batch([s]))

    # the reward model's own rendering and tokenization of the text gives the same score ...
    ids = rendered(other_tok, prompt, response)
    assert other_tok.decode(ids).startswith("<|im_start|>user\nAdd 9 and 9.<|im_end|>")
    assert ids != s.prompt_ids.tolist() + s.response_ids.tolist()
    (expected,) = rm_other.score_tokens([ids])
    assert got == pytest.approx(expected, abs=TOL)
    # ... and the chat template matters: the bare text scores differently
    (bare,) = rm_other.score_tokens([other_tok.encode(prompt + response)])
    assert abs(got - bare) > 100 * TOL


async def test_retokenize_decodes_ids_with_the_policy_tokenizer(
    rm_other: ModelSource, policy_tok: Any, other_tok: Any
) -> None:
    s = sample(policy_tok, "What is 3 + 4?", "7", with_text=False)
    (got,) = scores(await rm_other.score_batch([s]))
    prompt = policy_tok.decode(s.prompt_ids.tolist(), skip_special_tokens=True)
    response = policy_tok.decode(s.response_ids.tolist(), skip_special_tokens=True)
    assert response == "7"
    (expected,) = rm_other.score_tokens([rendered(other_tok, prompt, response)])
    assert got == pytest.approx(expected, abs=TOL)


async def test_retokenize_without_text_or_policy_tokenizer_fails_that_sample_only(
    tiny_models: TinyModelPaths, policy_tok: Any
) -> None:
    src = source("rm-other-bare", tiny_models.reward_model_other_tokenizer, retokenize="always")
    good = sample(policy_tok, "What is 3 + 4?", "7")
    no_text = sample(policy_tok, "What is 3 + 4?", "7", with_text=False)
    no_response_text = sample(policy_tok, "What is 3 + 4?", "7")
    no_response_text.response_text = ""
    results = await src.score_batch([good, no_text, no_response_text, good])
    assert isinstance(results[0], RewardOutput) and isinstance(results[3], RewardOutput)
    assert results[0].score == pytest.approx(results[3].score, abs=TOL)
    assert isinstance(results[1], InvalidInput) and "prompt_text" in str(results[1])
    assert isinstance(results[2], InvalidInput) and "response_text" in str(results[2])


async def test_retokenize_without_chat_template_concatenates(tiny_models: TinyModelPaths, other_tok: Any) -> None:
    src = source("rm-plain", tiny_models.reward_model_other_tokenizer, retokenize="always")
    src.tokenizer.chat_template = None
    s = RewardInput("s", np.zeros(0, np.int32), np.zeros(0, np.int32), "What is 3 + 4? ", "7")
    (got,) = scores(await src.score_batch([s]))
    (expected,) = src.score_tokens([other_tok.encode("What is 3 + 4? 7")])
    assert got == pytest.approx(expected, abs=TOL)


async def test_bad_samples_fail_alone(rm: ModelSource, policy_tok: Any) -> None:
    good = sample(policy_tok, "What is 3 + 4?", "7")
    empty = RewardInput("empty", np.zeros(0, np.int32), np.zeros(0, np.int32))
    out_of_vocab = sample(policy_tok, "What is 3 + 4?", "7")
    out_of_vocab.response_ids = np.array([5, rm.vocab_size + 10], np.int32)
    negative = sample(policy_tok, "What is 3 + 4?", "7")
    negative.prompt_ids = np.array([-1, 5], np.int32)
    results = await rm.score_batch([empty, good, out_of_vocab, negative])
    assert isinstance(results[0], InvalidInput) and "empty" in str(results[0])
    assert isinstance(results[1], RewardOutput)
    assert results[1].score == pytest.approx(rm.score_tokens([ids_of(good)])[0], abs=TOL)
    assert isinstance(results[2], InvalidInput) and "vocabulary" in str(results[2])
    assert isinstance(results[3], InvalidInput) and "-1" in str(results[3])
    with pytest.raises(InvalidInput):
        rm.score_tokens([np.zeros(0, np.int64)])


async def test_a_failed_forward_pass_fails_every_sample_in_it(
    tiny_models: TinyModelPaths, policy_tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = source("rm-broken", tiny_models.reward_model)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(src, "_forward_fn", boom)
    empty = RewardInput("empty", np.zeros(0, np.int32), np.zeros(0, np.int32))
    results = await src.score_batch([sample(policy_tok, *PAIRS[0]), empty, sample(policy_tok, *PAIRS[1])])
    assert isinstance(results[0], SourceFailed) and "out of memory" in str(results[0])
    assert isinstance(results[1], InvalidInput)
    assert isinstance(results[2], SourceFailed)
    assert isinstance(results[0].__cause__, RuntimeError)


async def test_truncation_keeps_the_end(tiny_models: TinyModelPaths, rm: ModelSource, policy_tok: Any) -> None:
    short = source("rm-short", tiny_models.reward_model, max_length=8)
    s = sample(policy_tok, *PAIRS[3])
    assert s.num_tokens > 8
    (got,) = scores(await short.score_batch([s]))
    assert got == pytest.approx(rm.score_tokens([ids_of(s)[-8:]])[0], abs=TOL)
    assert abs(got - rm.score_tokens([ids_of(s)])[0]) > 100 * TOL
    # the model's position limit caps max_length
    assert source("rm-long", tiny_models.reward_model, max_length=10**6).max_length == 4096


async def test_forward_runs_off_the_event_loop(
    tiny_models: TinyModelPaths, policy_tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = source("rm-slow", tiny_models.reward_model)
    real_forward = src._forward

    ticked = threading.Event()

    def slow_forward(seqs: list[np.ndarray]) -> list[float]:
        # A long forward pass, blocking whatever thread runs it until the event loop has ticked 10 times:
        # on the loop's own thread that never happens (no fixed sleep: a loaded machine ticks slowly).
        ticked.wait(30)
        return real_forward(seqs)

    monkeypatch.setattr(src, "_forward", slow_forward)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
            if ticks >= 10:
                ticked.set()

    task = asyncio.create_task(ticker())
    try:
        results = await src.score_batch([sample(policy_tok, *PAIRS[0])])
    finally:
        task.cancel()
    assert isinstance(results[0], RewardOutput)
    assert ticks >= 10


async def test_warmup_close_and_after(tiny_models: TinyModelPaths, policy_tok: Any) -> None:
    src = source("rm-close", tiny_models.reward_model)
    await src.warmup()
    assert await src.score_batch([]) == []
    await src.close()
    results = await src.score_batch([sample(policy_tok, *PAIRS[0])])
    assert isinstance(results[0], Unavailable)


async def test_dtype_override(tiny_models: TinyModelPaths, rm: ModelSource, policy_tok: Any) -> None:
    bf16 = source("rm-bf16", tiny_models.reward_model, dtype="bf16")
    assert bf16.dtype == torch.bfloat16
    s = sample(policy_tok, *PAIRS[0])
    (low,) = scores(await bf16.score_batch([s]))
    (full,) = scores(await rm.score_batch([s]))
    assert math.isfinite(low)
    assert low == pytest.approx(full, abs=0.1 * max(1.0, abs(full)))


def test_bad_configuration_is_a_clear_error(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        ModelSource("rm", str(missing))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        ModelSource("rm", str(tmp_path))  # a directory, but no model in it
    with pytest.raises(FileNotFoundError, match="policy_tokenizer"):
        ModelSource("rm", str(tiny_models.reward_model), policy_tokenizer=str(missing))
    with pytest.raises(ValueError, match="retokenize"):
        ModelSource("rm", str(tiny_models.reward_model), retokenize="sometimes")
    with pytest.raises(ValueError, match="dtype"):
        ModelSource("rm", str(tiny_models.reward_model), dtype="int3")
    with pytest.raises(ValueError, match="score_index"):
        ModelSource("rm", str(tiny_models.reward_model), score_index=1)
    with pytest.raises(ValueError, match="device"):
        ModelSource("rm", str(tiny_models.reward_model), device="toaster")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ModelSource("rm", str(tiny_models.reward_model), device="cuda")


# ------------------------------------------------------------------------------------------------------ serving


def test_length_buckets_split_only_where_padding_is_cut() -> None:
    same = np.full(32, 50)
    assert [len(g) for g in length_buckets(same, 4)] == [32]  # nothing to gain: one pass
    mixed = np.array([200] * 8 + [10] * 8 + [12] * 8)
    groups = length_buckets(mixed, 4)
    assert sorted(np.concatenate(groups).tolist()) == list(range(24))  # every row once
    assert [sorted({int(mixed[r]) for r in g}) for g in groups] == [[10, 12], [200]]
    padded = sum(len(g) * int(mixed[g].max()) for g in groups)
    assert padded < 0.5 * 24 * 200
    assert [len(g) for g in length_buckets(mixed, 1)] == [24]  # length_buckets=1: off
    assert [len(g) for g in length_buckets(np.array([5, 500, 6]), 4)] == [3]  # too few rows to split


async def test_buckets_do_not_change_scores(tiny_models: TinyModelPaths, policy_tok: Any) -> None:
    one_pass = source("rm-1", tiny_models.reward_model, length_buckets=1)
    bucketed = source("rm-4", tiny_models.reward_model, length_buckets=4)
    long_pair = PAIRS[3]
    batch = [sample(policy_tok, "1+1=", "2", sid=f"short{i}") for i in range(8)]
    batch += [sample(policy_tok, long_pair[0] * 2, long_pair[1], sid=f"long{i}") for i in range(8)]
    lengths = np.array([s.num_tokens for s in batch])
    assert len(length_buckets(lengths, 4)) > 1  # the batch really is split
    assert scores(await bucketed.score_batch(batch)) == pytest.approx(
        scores(await one_pass.score_batch(batch)), abs=TOL
    )


async def test_next_batch_is_staged_while_one_computes(
    tiny_models: TinyModelPaths, policy_tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two batches in flight: the second is built, padded and copied while the first holds the model. The
    first forward pass waits (while it holds the model) until the second batch is staged; if staging queued
    behind the model, that would never happen and the wait would time out."""
    src = source("rm-overlap", tiny_models.reward_model)
    real_stage, real_forward = src._stage, src._forward_fn
    stages = 0
    second_staged = threading.Event()
    first_waited: list[bool] = []

    def stage(*args: Any) -> Any:
        nonlocal stages
        out = real_stage(*args)
        stages += 1
        if stages == 2:
            second_staged.set()
        return out

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not first_waited:
            first_waited.append(second_staged.wait(60))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(src, "_stage", stage)
    monkeypatch.setattr(src, "_forward_fn", forward)
    first = [sample(policy_tok, *PAIRS[0], sid="a")]
    second = [sample(policy_tok, *PAIRS[1], sid="b")]
    got = await asyncio.gather(src.score_batch(first), src.score_batch(second))
    assert first_waited == [True]
    assert scores(got[0]) == pytest.approx(scores(await src.score_batch(first)), abs=TOL)


async def test_torch_compile_flag_scores_as_eager(tiny_models: TinyModelPaths, policy_tok: Any) -> None:
    """The flag's path through torch.compile (TorchDynamo tracing the forward), with the `eager` backend: it
    compiles this model in seconds here. Inductor's own code generation is the next test (slow on a CPU)."""
    eager = source("rm-eager", tiny_models.reward_model)
    compiled = source("rm-compiled", tiny_models.reward_model, torch_compile=True, compile_backend="eager")
    assert compiled.torch_compile and compiled._forward_fn is not compiled._backbone
    # A compiled graph would take in the hooks a pass gives way at: only the eager pass on the CPU pauses at its next
    # layer for a batch sent first; a compiled one finishes its pass, then that batch goes before any other.
    assert eager.capacity.overtakes and compiled.capacity.overtakes
    assert "gives way at its next layer" in eager.capacity.unit and "finishes its pass" in compiled.capacity.unit
    batch = [sample(policy_tok, p, r, sid=str(i)) for i, (p, r) in enumerate(PAIRS[:3])]  # one traced shape
    assert scores(await compiled.score_batch(batch)) == pytest.approx(scores(await eager.score_batch(batch)), abs=TOL)


@pytest.mark.skipif(
    os.environ.get("REWARDMESH_SLOW_TESTS") != "1",
    reason="torch.compile with inductor takes ~50 s for the first batch of this tiny model on the 2-core CPU "
    "(and ~10 s per new shape class): too slow for the suite; set REWARDMESH_SLOW_TESTS=1 to run it",
)
async def test_torch_compile_inductor_scores_as_eager(tiny_models: TinyModelPaths, policy_tok: Any) -> None:
    eager = source("rm-eager", tiny_models.reward_model)
    compiled = source("rm-inductor", tiny_models.reward_model, torch_compile=True)
    batch = [sample(policy_tok, p, r, sid=str(i)) for i, (p, r) in enumerate(PAIRS)]
    assert scores(await compiled.score_batch(batch)) == pytest.approx(scores(await eager.score_batch(batch)), abs=1e-3)
