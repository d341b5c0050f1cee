"""HFBackend on the real tiny policy: micro-batching, per-row sampling and stops, cancellation, weight swaps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server.rollout.backends import make_backend
from rewardmesh.server.rollout.backends.base import GenerationOutput, GenerationRequest, WeightsError
from rewardmesh.server.rollout.backends.hf import HFBackend
from rewardmesh.server.rollout.backends.hf_decode import cache_argument
from rewardmesh.server.rollout.backends.hf_kv_cache import SlotCache
from rewardmesh.server.rollout.backends.requests import trim_at_stop
from rewardmesh.server.rollout.backends.sampling import sample
from tests.support.waiting import eventually, holds_for

PROMPTS = [
    "What is 2 + 2?",
    "Tell me a short story about a cat.",
    "7 + 8 =",
    "The teacher checks the answer again and again, with care.",
    "Add 9 and 9.",
]


@pytest.fixture
async def backend(tiny_models: TinyModelPaths) -> AsyncIterator[HFBackend]:
    b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=20)
    await b.start()
    yield b
    await b.close()


def ids(backend: HFBackend, text: str) -> list[int]:
    return list(backend.tokenizer.encode(text))


def greedy(backend: HFBackend, text: str, max_tokens: int = 12, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=ids(backend, text), max_tokens=max_tokens, temperature=0.0, **kw)


def sampled(backend: HFBackend, text: str, seed: int | None, max_tokens: int = 30, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=ids(backend, text), max_tokens=max_tokens, temperature=1.0, seed=seed, **kw)


async def a_sample_without_eos(backend: HFBackend, text: str, min_len: int = 20) -> tuple[GenerationRequest, list[int]]:
    """A seeded sampled continuation that runs to max_tokens (no eos), to pick real stops from."""
    for seed in range(50):
        request = sampled(backend, text, seed=seed)
        out = await backend.generate(request)
        if out.finish_reason == "length" and len(out.token_ids) >= min_len:
            return request, out.token_ids
    raise AssertionError("every seed hit eos early")


# --------------------------------------------------------------------------------------------------- basics


async def test_generates_tokens_and_a_finish_reason(backend: HFBackend) -> None:
    out = await backend.generate(greedy(backend, PROMPTS[0], max_tokens=8))
    assert 1 <= len(out.token_ids) <= 8
    assert out.finish_reason in ("stop", "length")
    assert all(0 <= t < len(backend.tokenizer) for t in out.token_ids)
    assert (out.policy_version, out.num_preempted) == (0, 0)
    assert isinstance(backend.tokenizer.decode(out.token_ids), str)
    assert backend.name == "hf" and backend.max_model_len == 512 and backend.running == 0


async def test_max_tokens_is_respected(backend: HFBackend) -> None:
    for n in (1, 5, 17):
        out = await backend.generate(greedy(backend, PROMPTS[1], max_tokens=n))
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"


async def test_greedy_is_deterministic_alone_and_batched(backend: HFBackend) -> None:
    requests = [greedy(backend, p, max_tokens=16) for p in PROMPTS]
    alone = [await backend.generate(r) for r in requests]
    again = [await backend.generate(r) for r in requests]
    together = await asyncio.gather(*(backend.generate(r) for r in requests))
    assert [o.token_ids for o in alone] == [o.token_ids for o in again] == [o.token_ids for o in together]
    # the batch really reused the model with left padding (prompts have different lengths)
    assert backend.batch_sizes[-1] == len(PROMPTS)
    assert len({len(r.prompt_ids) for r in requests}) > 1


async def test_same_seed_same_tokens_alone_or_batched(backend: HFBackend) -> None:
    requests = [
        sampled(backend, PROMPTS[0], seed=11),
        sampled(backend, PROMPTS[1], seed=12, top_k=20),
        sampled(backend, PROMPTS[2], seed=13, top_p=0.8),
        sampled(backend, PROMPTS[3], seed=14, top_k=50, top_p=0.9),
        GenerationRequest(ids(backend, PROMPTS[4]), max_tokens=30, temperature=0.7, seed=15),
    ]
    alone = [await backend.generate(r) for r in requests]
    # batched with each other, and with unseeded strangers in the same micro-batch
    strangers = [sampled(backend, PROMPTS[i], seed=None) for i in range(3)]
    together = await asyncio.gather(*(backend.generate(r) for r in [*strangers, *requests]))
    assert backend.batch_sizes[-1] == len(strangers) + len(requests)
    assert [o.token_ids for o in alone] == [o.token_ids for o in together[len(strangers) :]]
    # and the seed matters
    other = await backend.generate(sampled(backend, PROMPTS[0], seed=99))
    assert other.token_ids != alone[0].token_ids


def test_sampler_filters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    argmax = logits.argmax(-1)
    temps = torch.ones(4)
    u = torch.rand(4)
    top1 = sample(logits, temps, torch.ones(4, dtype=torch.long), torch.ones(4), u)
    assert torch.equal(top1, argmax)
    tiny_p = sample(logits, temps, torch.zeros(4, dtype=torch.long), torch.full((4,), 1e-6), u)
    assert torch.equal(tiny_p, argmax)
    zero_t = sample(logits, torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4), u)
    assert torch.equal(zero_t, argmax)
    top5 = sample(logits, temps, torch.full((4,), 5, dtype=torch.long), torch.ones(4), u)
    allowed = logits.topk(5, dim=-1).indices
    assert all(int(t) in allowed[i].tolist() for i, t in enumerate(top5))
    # an unfiltered row draws the same token whatever its neighbours filter
    for _ in range(50):
        u = torch.rand(4)
        mixed = sample(logits, temps, torch.tensor([0, 5, 0, 2]), torch.tensor([1.0, 1.0, 0.3, 0.9]), u)
        plain = sample(logits[:1], temps[:1], torch.zeros(1, dtype=torch.long), torch.ones(1), u[:1])
        assert mixed[0] == plain[0]
        assert int(mixed[1]) in allowed[1].tolist()


def reference_logprobs(
    lm: Any, prompt: list[int], tokens: list[int], temperature: float, top_k: int = 0
) -> torch.Tensor:
    """What a learner computes: one forward pass over prompt + response, the logits scaled and filtered."""
    with torch.inference_mode():
        logits = lm(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 20), (0.0, 0)])
async def test_logprobs_match_a_separate_forward_pass(
    backend: HFBackend, tiny_models: TinyModelPaths, temperature: float, top_k: int
) -> None:
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_models.policy), dtype=torch.float32).eval()
    requests = [
        GenerationRequest(ids(backend, p), 24, temperature=temperature, top_k=top_k, seed=i, logprobs=True)
        for i, p in enumerate(PROMPTS[:3])
    ]
    # batched (left padding, rows finishing at different steps) with a neighbour that asks for none
    outs = await asyncio.gather(*(backend.generate(r) for r in [*requests, sampled(backend, PROMPTS[3], seed=7)]))
    assert outs[-1].logprobs is None
    for request, out in zip(requests, outs, strict=False):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
        assert out.token_versions == [0] * len(out.token_ids)
        want = reference_logprobs(lm, request.prompt_ids, out.token_ids, temperature, top_k)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=2e-4, rtol=1e-4)
        assert all(lp <= 0 for lp in out.logprobs)


async def test_logprobs_are_cut_with_a_stop_string(backend: HFBackend) -> None:
    request, tokens = await a_sample_without_eos(backend, PROMPTS[1])
    tok: Any = backend.tokenizer
    stop = tok.decode(tokens[10:12], skip_special_tokens=True).strip()
    assert stop
    out = await backend.generate(GenerationRequest(**{**vars(request), "stop": [stop], "logprobs": True}))
    assert out.finish_reason == "stop" and out.logprobs is not None and len(out.logprobs) == len(out.token_ids)


# ----------------------------------------------------------------------------------------------- batching


async def test_concurrent_requests_share_steps_up_to_max_num_seqs(tiny_models: TinyModelPaths) -> None:
    b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=20, max_num_seqs=3)
    try:
        outs = await asyncio.gather(*(b.generate(greedy(b, p, max_tokens=4)) for p in [*PROMPTS, *PROMPTS]))
        assert all(len(o.token_ids) == 4 for o in outs)
        assert max(b.running_sizes) == 3  # several requests per forward pass, never more than the cap
        assert b.batch_sizes[0] == 3 and sum(b.batch_sizes) == 2 * len(PROMPTS)
        # 10 requests of 4 tokens, 3 rows at a time: a row joins as soon as one leaves, so 4 full waves of
        # steps are not needed: every step but the tail runs 3 rows
        assert b.steps <= 4 * 4
    finally:
        await b.close()


@pytest.mark.slow
async def test_token_budget_bounds_the_running_batch(tiny_models: TinyModelPaths) -> None:
    b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=20, max_batch_tokens=40)
    try:
        requests = [greedy(b, p, max_tokens=20) for p in PROMPTS]  # each reserves prompt + 20 > 20 tokens
        outs = await asyncio.gather(*(b.generate(r) for r in requests))
        assert all(len(o.token_ids) == 20 or o.finish_reason == "stop" for o in outs)
        assert max(b.running_sizes) == 1  # two never fit the budget together
        big = await b.generate(greedy(b, PROMPTS[1], max_tokens=60))  # larger than the budget: runs alone
        assert len(big.token_ids) == 60 or big.finish_reason == "stop"
    finally:
        await b.close()


@pytest.mark.slow
async def test_each_request_resolves_when_its_own_row_finishes(backend: HFBackend) -> None:
    long_task = asyncio.create_task(backend.generate(greedy(backend, PROMPTS[3], max_tokens=300)))
    short_task = asyncio.create_task(backend.generate(greedy(backend, PROMPTS[0], max_tokens=2)))
    done, _ = await asyncio.wait({long_task, short_task}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {short_task}
    assert not long_task.done()
    assert backend.running == 1  # the delivered row no longer counts
    short, long = short_task.result(), await long_task
    assert backend.batch_sizes[-1] == 2  # they really were prefilled together
    assert len(short.token_ids) == 2 and len(long.token_ids) == 300


async def test_a_request_arriving_mid_batch_joins_within_two_steps(backend: HFBackend) -> None:
    alone = await backend.generate(greedy(backend, PROMPTS[1], max_tokens=5))
    first = asyncio.create_task(backend.generate(greedy(backend, PROMPTS[0], max_tokens=300)))
    await eventually(lambda: backend.steps >= 10, "backend.steps >= 10", every_s=0.002)
    second = await backend.generate(greedy(backend, PROMPTS[1], max_tokens=5))
    assert not first.done()  # it joined the running batch instead of waiting for it to end
    # Counted by the decode loop itself, arrival -> first token: the steps the worker thread runs while this
    # test's event loop gets round to reading `backend.steps` depend on the machine's load, so they are not used.
    assert backend.admission_waits[-1] <= 2
    assert second.token_ids == alone.token_ids  # joining a padded batch changes nothing
    assert max(backend.running_sizes) == 2
    first.cancel()


@pytest.mark.slow
async def test_rows_joining_and_leaving_keep_every_row_exact(backend: HFBackend) -> None:
    """Seeded rows give the same tokens alone and when they join a batch at different steps."""
    requests = [sampled(backend, p, seed=20 + i, max_tokens=10 + 7 * i) for i, p in enumerate(PROMPTS)]
    requests.append(greedy(backend, PROMPTS[3] * 3, max_tokens=25))  # the longest prompt joins last
    alone = [await backend.generate(r) for r in requests]
    tasks = []
    for r in requests:
        tasks.append(asyncio.create_task(backend.generate(r)))
        steps = backend.steps
        await eventually(lambda s=steps: backend.steps >= s + 3, "backend.steps >= s + 3", every_s=0.002)  # type: ignore[misc]
    together = await asyncio.gather(*tasks)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert max(backend.running_sizes) >= 3


# ------------------------------------------------------------------------------------------------- stops


async def test_stop_token_ids_are_honoured(backend: HFBackend) -> None:
    request, tokens = await a_sample_without_eos(backend, PROMPTS[1])
    k = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    request.stop_token_ids = [tokens[k]]
    out = await backend.generate(request)
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: k + 1]  # the stop token itself is returned, like eos


async def test_min_tokens_holds_back_stop_tokens_and_ignore_eos_keeps_going(backend: HFBackend) -> None:
    request, tokens = await a_sample_without_eos(backend, PROMPTS[1])
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    request.stop_token_ids, request.min_tokens = [tokens[k]], k + 6
    held = await backend.generate(request)
    assert len(held.token_ids) >= k + 6 and tokens[k] not in held.token_ids[: k + 5]  # never drawn early, as vLLM
    eos = backend.tokenizer.eos_token_id
    for seed in range(200):
        ended = await backend.generate(sampled(backend, PROMPTS[0], seed=seed, max_tokens=24))
        if ended.finish_reason == "stop" and ended.token_ids[-1] == eos and len(ended.token_ids) < 24:
            break
    else:
        pytest.skip("no seed drew eos")
    going = await backend.generate(sampled(backend, PROMPTS[0], seed=seed, max_tokens=24, ignore_eos=True))
    assert going.finish_reason == "length" and going.token_ids[: len(ended.token_ids)] == ended.token_ids


async def test_stop_strings_are_honoured_and_not_returned(backend: HFBackend) -> None:
    request, tokens = await a_sample_without_eos(backend, PROMPTS[2])
    tok: Any = backend.tokenizer
    text = tok.decode(tokens, skip_special_tokens=True)
    start = len(tok.decode(tokens[:4], skip_special_tokens=True))
    # a 2-character ASCII piece of what the model really writes, first seen after its fourth token
    pos, stop = next(
        (p, text[p : p + 2])
        for p in range(start, len(text) - 2)
        if text[p : p + 2].isascii() and text[p : p + 2].isprintable() and text[p : p + 2] not in text[: p + 1]
    )
    request.stop = ["never-produced-stop", stop]
    out = await backend.generate(request)
    assert out.finish_reason == "stop"
    kept = tok.decode(out.token_ids, skip_special_tokens=True)
    assert stop not in kept
    assert text.startswith(kept) and len(kept) <= pos
    assert out.token_ids == tokens[: len(out.token_ids)]
    # whole tokens only: one more token would run into the stop string
    assert len(tok.decode(tokens[: len(out.token_ids) + 1], skip_special_tokens=True)) > pos
    assert trim_at_stop(tok, tokens, [stop]) == out.token_ids

    request.stop = ["never-produced-stop"]
    assert (await backend.generate(request)).token_ids == tokens


# ---------------------------------------------------------------------------------------------- cancelling


async def test_cancelling_aborts_the_row_and_stops_the_batch(backend: HFBackend) -> None:
    task = asyncio.create_task(backend.generate(greedy(backend, PROMPTS[0], max_tokens=400)))
    await eventually(lambda: backend.steps >= 3, "backend.steps >= 3", every_s=0.002)
    assert backend.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.running == 0
    steps = backend.steps
    # Decoding stopped instead of going on for a row nobody awaits.
    await holds_for(lambda: backend.steps <= steps + 1, "no decoding for a cancelled row", 0.2)


@pytest.mark.slow
async def test_cancelling_one_row_leaves_its_neighbours_intact(backend: HFBackend) -> None:
    keep_request = sampled(backend, PROMPTS[1], seed=5, max_tokens=60)
    expected = await backend.generate(keep_request)
    victim = asyncio.create_task(backend.generate(greedy(backend, PROMPTS[3], max_tokens=400)))
    keeper = asyncio.create_task(backend.generate(keep_request))
    await eventually(lambda: backend.num_batches == 2, "backend.num_batches == 2", every_s=0.002)
    victim.cancel()
    out = await keeper
    assert out.token_ids == expected.token_ids
    assert victim.cancelled()
    assert backend.running == 0


async def test_cancelling_a_queued_request_never_runs_it(tiny_models: TinyModelPaths) -> None:
    b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=300)
    await b.start()
    try:
        task = asyncio.create_task(b.generate(greedy(b, PROMPTS[0])))
        await eventually(lambda: b.running == 1, "b.running == 1", every_s=0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.running == 0
        await holds_for(lambda: b.num_batches == 0, "the cancelled request never runs", 0.4)  # past batch_wait_ms
    finally:
        await b.close()


async def test_close_fails_pending_requests(tiny_models: TinyModelPaths) -> None:
    b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=1)
    await b.start()
    running = asyncio.create_task(b.generate(greedy(b, PROMPTS[0], max_tokens=400)))
    await eventually(lambda: b.num_batches == 1, "b.num_batches == 1", every_s=0.002)
    queued = asyncio.create_task(b.generate(greedy(b, PROMPTS[1], max_tokens=400)))
    await eventually(lambda: b.running == 2, "b.running == 2", every_s=0.002)
    await b.close()
    for task in (running, queued):
        with pytest.raises(RuntimeError, match="closed"):
            await task
    with pytest.raises(RuntimeError, match="closed"):
        await b.generate(greedy(b, PROMPTS[0]))


# ------------------------------------------------------------------------------------------------ limits


@pytest.mark.slow
async def test_prompt_plus_max_tokens_beyond_max_model_len_is_rejected(
    backend: HFBackend, tiny_models: TinyModelPaths
) -> None:
    prompt = ids(backend, PROMPTS[3])
    ok = await backend.generate(GenerationRequest(prompt, max_tokens=512 - len(prompt), temperature=0.0))
    assert len(ok.token_ids) == 512 - len(prompt)
    with pytest.raises(ValueError, match="max_tokens") as info:
        await backend.generate(GenerationRequest(prompt, max_tokens=513 - len(prompt)))
    assert "512" in str(info.value)
    assert backend.running == 0

    small = HFBackend(str(tiny_models.policy), num_threads=1, max_model_len=16)
    try:
        assert small.max_model_len == 16
        with pytest.raises(ValueError, match=r"max_tokens.*16"):
            await small.generate(GenerationRequest(prompt, max_tokens=16))
    finally:
        await small.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_ids": []}, "empty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 13}, "min_tokens"),
        ({"prompt_ids": [1, 100000]}, "vocabulary"),
    ],
)
async def test_invalid_requests_are_rejected_up_front(backend: HFBackend, change: dict[str, Any], message: str) -> None:
    request = greedy(backend, PROMPTS[0])
    for key, value in change.items():
        setattr(request, key, value)
    with pytest.raises(ValueError, match=message):
        await backend.generate(request)
    assert backend.num_batches == 0


# ----------------------------------------------------------------------------------------------- weights


def perturbed_state(tiny_models: TinyModelPaths, scale: float = 0.5) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(tiny_models.policy, local_files_only=True)
    gen = torch.Generator().manual_seed(1)
    return {
        name: (t + scale * torch.randn(t.shape, generator=gen)).to(torch.bfloat16 if "mlp" in name else t.dtype)
        for name, t in model.state_dict().items()
    }


def original_state(tiny_models: TinyModelPaths) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(tiny_models.policy, local_files_only=True)
    return {name: t.clone() for name, t in model.state_dict().items()}


async def test_weight_specs_come_from_the_state_dict(backend: HFBackend, tiny_models: TinyModelPaths) -> None:
    specs = backend.weight_specs()
    state = original_state(tiny_models)
    assert set(specs) == set(state)
    assert all(specs[n] == (tuple(t.shape), torch.float32) for n, t in state.items())


async def test_update_weights_changes_output_and_version(backend: HFBackend, tiny_models: TinyModelPaths) -> None:
    requests = [greedy(backend, p, max_tokens=12) for p in PROMPTS]
    before = [o.token_ids for o in await asyncio.gather(*(backend.generate(r) for r in requests))]

    await backend.update_weights(perturbed_state(tiny_models), version=7)
    assert backend.policy_version == 7
    after = await asyncio.gather(*(backend.generate(r) for r in requests))
    assert all(o.policy_version == 7 for o in after)
    assert [o.token_ids for o in after] != before

    await backend.update_weights(original_state(tiny_models), version=8)
    restored = await asyncio.gather(*(backend.generate(r) for r in requests))
    assert [o.token_ids for o in restored] == before
    assert all(o.policy_version == 8 for o in restored)


@pytest.mark.slow
async def test_update_weights_lands_between_steps_and_tokens_say_which(
    backend: HFBackend, tiny_models: TinyModelPaths
) -> None:
    request = greedy(backend, PROMPTS[3], max_tokens=200)
    baseline = await backend.generate(request)
    steps = backend.steps
    in_flight = asyncio.create_task(backend.generate(request))
    await eventually(lambda: backend.steps >= steps + 5, "backend.steps >= steps + 5", every_s=0.002)
    await backend.update_weights(perturbed_state(tiny_models), version=1)
    assert not in_flight.done()  # the swap did not wait for the running row to end
    mixed = await in_flight
    versions = mixed.token_versions
    n = len(mixed.token_ids)
    assert versions is not None and len(versions) == n and (n == 200 or mixed.finish_reason == "stop")
    switch = versions.index(1)
    assert versions == [0] * switch + [1] * (n - switch) and switch >= 5  # one clean switch between steps
    assert mixed.policy_version == 0  # the oldest weights that contributed
    assert mixed.token_ids[:switch] == baseline.token_ids[:switch]
    new = await backend.generate(request)
    assert new.policy_version == 1 and new.token_versions == [1] * len(new.token_ids)
    assert new.token_ids != baseline.token_ids


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"model.no_such_layer.weight": torch.zeros(3)}, r"model\.no_such_layer\.weight"),
        ({"model.norm.weight": torch.zeros(65)}, r"model\.norm\.weight.*shape \(65,\).*\(128,\)"),
        ({"model.norm.weight": torch.zeros(128, dtype=torch.int64)}, r"model\.norm\.weight.*dtype"),
        ({"model.norm.weight": torch.zeros(128, dtype=torch.float64)}, r"model\.norm\.weight.*dtype"),
    ],
)
async def test_bad_weights_are_rejected_and_nothing_is_applied(
    backend: HFBackend, tiny_models: TinyModelPaths, bad: dict[str, torch.Tensor], message: str
) -> None:
    request = greedy(backend, PROMPTS[0], max_tokens=12)
    before = await backend.generate(request)
    tensors = perturbed_state(tiny_models)  # every good tensor comes first: none of them may land
    tensors.update(bad)
    with pytest.raises(WeightsError, match=message):
        await backend.update_weights(tensors, version=3)
    assert backend.policy_version == 0
    after = await backend.generate(request)
    assert after.token_ids == before.token_ids and after.policy_version == 0


# ------------------------------------------------------------------------------------------------ factory


async def test_make_backend(tiny_models: TinyModelPaths) -> None:
    threads = torch.get_num_threads()
    b = make_backend("hf", str(tiny_models.policy), batch_wait_ms=1.0, max_num_seqs=4, num_threads=1)
    assert isinstance(b, HFBackend) and b.max_num_seqs == 4
    out = await b.generate(greedy(b, PROMPTS[0], max_tokens=3))  # starts on demand
    assert len(out.token_ids) == 3
    assert torch.get_num_threads() == threads  # the cap stayed on the decode thread
    await b.close()
    with pytest.raises(ValueError, match=r"'hf'.*'vllm'"):
        make_backend("sglang", str(tiny_models.policy))


# ----------------------------------------------------------------------------------------- the KV cache


def test_slot_cache_keeps_every_rows_columns_through_moves_and_growth() -> None:
    """Rows written, removed (the last row fills the hole) and carried through shifts and reallocations
    keep exactly their own history, in order, ending at the write column."""
    cache = SlotCache(1)
    history: list[list[float]] = []  # per slot, the values written for that row, in order
    starts: list[int] = []
    counter = 0.0

    def forward(prompts: list[int]) -> None:
        nonlocal counter
        old = len(history)
        n, width = old + len(prompts), max(prompts, default=1)
        shift = cache.reserve(n, width)
        starts[:] = [s + shift for s in starts]
        w = cache.w
        keys = torch.zeros((n, 1, width, 1))
        for r in range(n):
            length = 1 if r < old else prompts[r - old]
            values = [counter + i for i in range(length)]
            counter += length
            keys[r, 0, width - length :, 0] = torch.tensor(values)
            if r < old:
                history[r] += values
            else:
                history.append(values)
                starts.append(w + 1 - length)
        cache.n, cache.read_lo = n, min(starts)
        cache.prompts = [(old + j, length) for j, length in enumerate(prompts)]
        k, _ = cache.update(keys, keys, 0)
        cache.w, cache.lo, cache.prompts = w + 1, min(starts), []
        assert k.shape[0] == n and k.shape[2] == w + 1 - cache.read_lo

    def remove(slot: int) -> None:
        last = len(history) - 1
        if slot != last:
            cache.move_rows(torch.tensor([last]), torch.tensor([slot]))
            history[slot], starts[slot] = history[last], starts[last]
        history.pop()
        starts.pop()
        cache.lo = min(starts)

    def check() -> None:
        keys = cache.k[0]
        assert keys is not None
        for r, values in enumerate(history):
            assert cache.w - starts[r] == len(values)
            assert keys[r, 0, starts[r] : cache.w, 0].tolist() == values

    forward([3, 5])
    for i in range(150):
        forward([7] if i % 20 == 5 else [])  # a new row every 20 steps
        if i % 20 == 15 and len(history) > 1:
            remove(starts.index(min(starts)))  # the oldest leaves: the last row takes its slot
        check()
    assert cache.grows and cache.shifts  # both relayouts happened and kept every row intact
    assert cache.w - cache.lo < 2 * 40 + 2  # dead columns were reclaimed, the live window is short


@pytest.fixture(scope="module")
def sliding_policy(tiny_models: TinyModelPaths, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny sliding-window model (random Mistral) with the tiny policy's tokenizer: the general cache path."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("sliding-policy")
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=511,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
    )
    MistralForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_models.policy)).save_pretrained(out)
    return str(out)


async def test_a_sliding_window_model_runs_on_the_general_cache(sliding_policy: str) -> None:
    """Sliding-window layers cannot share the slot cache: rows still batch, seeded rows still match alone."""
    b = HFBackend(sliding_policy, num_threads=1, batch_wait_ms=20)
    try:
        requests = [sampled(b, p, seed=30 + i, max_tokens=12 + 4 * i) for i, p in enumerate(PROMPTS[:3])]
        alone = [await b.generate(r) for r in requests]
        assert not b._use_slots
        together = await asyncio.gather(*(b.generate(r) for r in requests))
        assert b.batch_sizes[-1] == 3 and [o.token_ids for o in together] == [o.token_ids for o in alone]
        # a request arriving mid-batch waits for an empty batch here, then runs: no step decodes the two together
        # (counted by the decode loop; which of their results the event loop hands out first is its own timing)
        since = len(b.running_sizes)
        first = asyncio.create_task(b.generate(greedy(b, PROMPTS[0], max_tokens=40)))
        steps = b.steps
        await eventually(lambda: b.steps >= steps + 3, "b.steps >= steps + 3", 30, every_s=0.002)
        second = await b.generate(greedy(b, PROMPTS[1], max_tokens=5))
        assert len(second.token_ids) == 5 or second.finish_reason == "stop"
        assert len((await first).token_ids) == 40 or first.result().finish_reason == "stop"
        assert set(list(b.running_sizes)[since:]) == {1} and max(b.running_sizes) == 3
    finally:
        await b.close()


async def test_eager_attention_takes_the_additive_mask_and_matches_sdpa(
    tiny_models: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot cache's mask is boolean for sdpa and additive for eager: both give the same rows."""
    import transformers

    async def staggered(b: HFBackend) -> list[GenerationOutput]:
        requests = [sampled(b, p, seed=50 + i, max_tokens=12 + 4 * i, logprobs=True) for i, p in enumerate(PROMPTS[:4])]
        tasks = []
        for r in requests:  # each joins a running batch
            tasks.append(asyncio.create_task(b.generate(r)))
            steps = b.steps
            await eventually(lambda s=steps: b.steps >= s + 2, "b.steps >= s + 2", 30, every_s=0.002)  # type: ignore[misc]
        return list(await asyncio.gather(*tasks))

    outputs = []
    for attention in ("sdpa", "eager"):
        load = transformers.AutoModelForCausalLM.from_pretrained
        with monkeypatch.context() as m:
            m.setattr(
                transformers.AutoModelForCausalLM,
                "from_pretrained",
                lambda *a, _load=load, _impl=attention, **k: _load(*a, attn_implementation=_impl, **k),
            )
            b = HFBackend(str(tiny_models.policy), num_threads=1, batch_wait_ms=20)
            await b.start()
        try:
            assert b._lm.config._attn_implementation == attention and b._use_slots
            outputs.append(await staggered(b))
        finally:
            await b.close()
    sdpa, eager = outputs
    assert [o.token_ids for o in sdpa] == [o.token_ids for o in eager]
    for x, y in zip(sdpa, eager, strict=True):
        assert x.logprobs is not None and y.logprobs is not None
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4)


def test_the_kv_cache_goes_under_the_name_the_models_forward_takes() -> None:
    """`cache` where transformers renamed it (`past_key_values` warns there, and goes in 5.40), the old name before;
    the whole suite runs with warnings as errors, so a decode step that warned would fail every hf test."""

    class Renamed(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: Any = None) -> None: ...

    class Before(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> None: ...

    assert cache_argument(Renamed()) == "cache" and cache_argument(Before()) == "past_key_values"
