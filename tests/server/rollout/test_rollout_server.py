"""Rollout server over real gRPC with real reward servers: streaming, overlap, failover, weights, bad input."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc import aio

from rewardmesh.common.planes.grpc_chunks import iter_update_requests
from rewardmesh.common.tensors import ids_from, ids_tensor, tensor_to_numpy
from rewardmesh.server.rollout.backends.base import GenerationOutput, GenerationRequest
from rewardmesh.v1 import common_pb2, rollout_pb2
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import fn_pipeline, reward_server, rollout_server, rollout_stub
from tests.support.waiting import eventually


def timed_script(text: str, turn: int) -> tuple[str, float]:
    """Generation time is written in the prompt: 'wait 0.3' takes 0.3 s; the answer is '#### 4'."""
    seconds = float(text.split("wait ")[1].split()[0]) if "wait " in text else 0.0
    return "so #### 4", seconds


def prompt(tok: Any, text: str, group: str = "", truth: str = "4", **kw: Any) -> rollout_pb2.Prompt:
    return rollout_pb2.Prompt(group_id=group, token_ids=ids_tensor(tok.encode(text)), ground_truth=truth,
                              data_source="openai/gsm8k", **kw)  # fmt: skip


def gen_request(prompts: list[rollout_pb2.Prompt], n: int = 1, reward: str = "", **kw: Any) -> Any:
    return rollout_pb2.GenerateRequest(prompts=prompts, n=n, reward=reward,
                                       sampling=rollout_pb2.SamplingParams(max_tokens=64), **kw)  # fmt: skip


def hold_until(backend: ScriptedBackend, marker: str, released: asyncio.Event) -> None:
    """Prompts containing `marker` start generating only once `released` is set (at most 60 s: then they fail, and
    the test with them): an order the test controls, not one timing makes likely."""
    original = backend.generate

    async def held(request: Any) -> Any:
        if marker in backend.tokenizer.decode(request.prompt_ids):
            await asyncio.wait_for(released.wait(), 60)
        return await original(request)

    backend.generate = held  # type: ignore[method-assign]


async def test_samples_stream_back_scored_fast_ones_first(tok: Any) -> None:
    """The slow group generates only once both fast samples have come back scored: they stream out as they
    finish, not in request order or at the end."""
    backend = ScriptedBackend(tok, timed_script)
    fast_back = asyncio.Event()
    hold_until(backend, "slow", fast_back)
    async with reward_server() as rs, rollout_server(backend, [rs.address]) as ro, rollout_stub(ro.address) as stub:
        prompts = [prompt(tok, "wait 0.4 slow", "slow"), prompt(tok, "wait 0.0 fast", "fast")]
        got = []
        async for r in stub.Generate(gen_request(prompts, n=2, reward="gsm8k")):
            got.append(r)
            if [g.sample.group_id for g in got] == ["fast", "fast"]:
                fast_back.set()
    assert [r.sample.group_id for r in got] == ["fast", "fast", "slow", "slow"]
    assert sorted(r.sample.sample_id for r in got) == ["fast/0", "fast/1", "slow/0", "slow/1"]
    for r in got:
        s = r.sample
        assert not r.result.HasField("error") and r.result.score == 1.0 and r.result.sample_id == s.sample_id
        assert s.finish_reason == common_pb2.FINISH_REASON_STOP and s.timing.num_turns == 1
        assert s.timing.reward > 0 and s.timing.reward >= s.timing.reward_compute
        assert s.timing.response_length == len(ids_from(s.response_ids, "r")) > 0
        assert ids_from(s.response_mask, "m").tolist() == [1] * s.timing.response_length  # no tool: all the policy's
        versions = tensor_to_numpy(s.response_policy_versions, "v", ndim=1)
        assert versions.dtype == np.int64 and versions.tolist() == [0] * s.timing.response_length
        assert s.response_text == "so #### 4" and s.ground_truth == "4"
    slow = next(r for r in got if r.sample.group_id == "slow")
    assert slow.sample.timing.generate_sequences >= 0.35


async def test_reward_overlaps_generation(tok: Any) -> None:
    """With a reward that sleeps per sample, a scored sample comes back while later samples of the same call have
    not even started generating: they are held until the first scored sample has arrived."""
    backend = ScriptedBackend(tok, timed_script)
    first_back = asyncio.Event()
    hold_until(backend, "later", first_back)
    async with reward_server({"sleepy": fn_pipeline("sleepy")}) as rs, rollout_server(backend, [rs.address]) as ro:
        async with rollout_stub(ro.address) as stub:
            texts = ["wait 0.1 first", *(f"wait 0.1 later {i}" for i in range(5))]
            prompts = [prompt(tok, text, f"g{i}", extra_info=None) for i, text in enumerate(texts)]
            for p in prompts:
                p.extra_info.update({"delay": 0.15})
            got = []
            async for r in stub.Generate(gen_request(prompts, reward="sleepy")):
                assert not r.result.HasField("error")
                first_back.set()  # had the call held its samples back until all were generated: a hang, failed
                got.append(r.sample.group_id)
    assert len(got) == 6 and got[0] == "g0"


async def test_reward_target_killed_mid_stream_is_rerouted(tok: Any) -> None:
    backend = ScriptedBackend(tok, timed_script)
    pipes = {"sleepy": fn_pipeline("sleepy")}
    async with (
        reward_server(pipes) as a,
        reward_server(pipes) as b,
        rollout_server(backend, [a.address, b.address]) as ro,
    ):
        async with rollout_stub(ro.address) as stub:
            prompts = [prompt(tok, "wait 0.05", f"g{i}") for i in range(10)]
            for p in prompts:
                p.extra_info.update({"delay": 0.5})

            async def kill_a() -> None:
                await eventually(lambda: a.servicer.in_flight > 0, "samples in a's queue")
                await a.grpc.server.stop(0)

            killer = asyncio.create_task(kill_a())
            got = [r async for r in stub.Generate(gen_request(prompts, n=3, reward="sleepy"))]
            await killer
        rerouted = ro.rewards.rerouted if ro.rewards else 0
    ids = [r.sample.sample_id for r in got]
    assert len(ids) == 30 and len(set(ids)) == 30
    assert all(not r.result.HasField("error") for r in got), [r.result.error for r in got]
    assert rerouted >= 1 and b.servicer.results_sent >= 15


async def test_no_reward_named_returns_unscored_samples(tok: Any) -> None:
    async with rollout_server(ScriptedBackend(tok, timed_script)) as ro, rollout_stub(ro.address) as stub:
        got = [r async for r in stub.Generate(gen_request([prompt(tok, "hi")], n=2))]
    assert len(got) == 2 and not any(r.HasField("result") for r in got)
    assert got[0].sample.timing.reward == 0


async def test_token_id_prompt_passes_through_unchanged_and_chat_text_is_the_question(tok: Any) -> None:
    """A token-id prompt's tensor comes back byte for byte; prompt_text is the untemplated prompt for both kinds."""
    ids = common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[3], raw_data=np.array(tok.encode("hi there")[:3],
                            dtype="<i4").tobytes())  # fmt: skip
    chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="system", content="Be brief."),
                                            rollout_pb2.ChatMessage(role="user", content="What is 2+2?")])  # fmt: skip
    prompts = [rollout_pb2.Prompt(group_id="ids", token_ids=ids), rollout_pb2.Prompt(group_id="chat", chat=chat)]
    async with rollout_server(ScriptedBackend(tok, timed_script)) as ro, rollout_stub(ro.address) as stub:
        got = {r.sample.group_id: r.sample async for r in stub.Generate(gen_request(prompts))}
    assert got["ids"].prompt_ids == ids
    assert got["ids"].prompt_text == tok.decode(ids_from(ids, "p").tolist(), skip_special_tokens=True)
    assert got["chat"].prompt_text == "What is 2+2?"
    assert got["chat"].timing.prompt_length == len(ids_from(got["chat"].prompt_ids, "p")) > 3


async def test_chat_prompt_and_tool_loop_through_the_server(tok: Any) -> None:
    def script(text: str, turn: int) -> tuple[str, float]:
        if turn == 0:
            return '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>', 0.0
        return "#### 4", 0.0

    chat = rollout_pb2.ChatPrompt(messages=[rollout_pb2.ChatMessage(role="user", content="What is 2+2?")])
    req = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(group_id="c", chat=chat, ground_truth="4")], n=1, reward="gsm8k",
        sampling=rollout_pb2.SamplingParams(max_tokens=128),
        agent=rollout_pb2.AgentLoopConfig(max_turns=3, tools=["calculator"]),
    )  # fmt: skip
    async with reward_server() as rs, rollout_server(ScriptedBackend(tok, script), [rs.address]) as ro:
        async with rollout_stub(ro.address) as stub:
            (r,) = [x async for x in stub.Generate(req)]
    mask = ids_from(r.sample.response_mask, "m")
    assert r.sample.timing.num_turns == 2 and r.sample.timing.tool_calls > 0
    assert 0 < int(mask.sum()) < len(mask)  # tool tokens masked out
    assert r.sample.prompt_text == "What is 2+2?" and "<|im_start|>" in tok.decode(ids_from(r.sample.prompt_ids, "p"))
    assert r.result.score == 1.0


async def test_bad_requests_are_invalid_argument_naming_the_field(tok: Any) -> None:
    good = prompt(tok, "hi")
    short_bytes = common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[3], raw_data=b"\x00")
    cases = [
        (gen_request([]), "prompts is empty"),
        (gen_request([good], n=0), "n must be >= 1"),
        (rollout_pb2.GenerateRequest(prompts=[good], n=1, sampling=rollout_pb2.SamplingParams(max_tokens=5000)),
         "sampling.max_tokens 5000"),
        (gen_request([good], agent=rollout_pb2.AgentLoopConfig(tools=["web_search"])), "agent.tools[0]: unknown tool"),
        (gen_request([rollout_pb2.Prompt(group_id="x")]), "prompts[0] has no input"),
        (gen_request([rollout_pb2.Prompt(token_ids=ids_tensor([]))]), "prompts[0].token_ids is empty"),
        (gen_request([rollout_pb2.Prompt(token_ids=short_bytes)]), "prompts[0].token_ids.raw_data"),
        (gen_request([good], reward="gsm8k"), "no --reward-target"),
    ]  # fmt: skip
    async with rollout_server(ScriptedBackend(tok, timed_script)) as ro, rollout_stub(ro.address) as stub:
        for req, text in cases:
            with pytest.raises(aio.AioRpcError) as info:
                _ = [r async for r in stub.Generate(req)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
            assert text in (info.value.details() or ""), (text, info.value.details())
        ok = [r async for r in stub.Generate(gen_request([good]))]  # still serving
    assert len(ok) == 1


class OneBadSample(ScriptedBackend):
    """Sample 1 of each prompt (seed 1) comes back with a token id no tensor of the wire can hold: a backend bug."""

    async def generate(self, request: GenerationRequest) -> GenerationOutput:
        out = await super().generate(request)
        if request.seed == 1:
            out.token_ids = [*out.token_ids, 1 << 40]
        return out


async def test_a_sample_that_cannot_be_built_is_its_own_error_and_its_group_is_answered(tok: Any) -> None:
    async with reward_server() as rs, rollout_server(OneBadSample(tok, timed_script), [rs.address]) as ro:
        async with rollout_stub(ro.address) as stub:
            request = gen_request([prompt(tok, "2 + 2", "g")], n=3, reward="gsm8k")
            request.sampling.seed = 0
            got = {r.sample.sample_id: r async for r in stub.Generate(request, timeout=30)}
    assert sorted(got) == ["g/0", "g/1", "g/2"]
    assert got["g/1"].result.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "OverflowError" in got["g/1"].result.error.message
    assert all(got[s].result.score == 1.0 and not got[s].result.HasField("error") for s in ("g/0", "g/2"))


async def test_client_cancel_aborts_in_flight_generations(tok: Any) -> None:
    backend = ScriptedBackend(tok, timed_script)
    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        prompts = [prompt(tok, "wait 0.0", "quick")] + [prompt(tok, "wait 30", f"stuck{i}") for i in range(4)]
        call = stub.Generate(gen_request(prompts))
        first = await call.read()
        assert first.sample.group_id == "quick"
        assert backend.running == 4
        call.cancel()
        await eventually(lambda: backend.running == 0, "the cancelled generations are aborted")
        info = await stub.GetInfo(rollout_pb2.GetInfoRequest())
    assert backend.running == 0 and backend.cancelled == 4
    assert info.load.running_samples == 0 and info.load.active_requests == 0


async def test_update_weights_applies_atomically_and_validates(tok: Any) -> None:
    backend = ScriptedBackend(tok, timed_script)

    def stream(state: dict[str, torch.Tensor], version: int = 0, chunk: int = 4) -> Any:
        for raw in iter_update_requests(state, version, chunk_bytes=chunk):
            yield rollout_pb2.UpdateWeightsRequest.FromString(raw)

    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        new = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
        resp = await stub.UpdateWeights(stream({"w": new}))  # 8 bytes in 4-byte chunks
        assert resp.policy_version == 1 and resp.num_tensors == 1 and resp.num_bytes == 8
        assert torch.equal(backend.weights["w"], new.float())
        resp = await stub.UpdateWeights(stream({"w": new * 2}, version=7))
        assert resp.policy_version == 7
        bad = [
            ({"nope": torch.zeros(2, 2)}, "unknown tensor 'nope'"),
            ({"w": torch.zeros(3, 2)}, "tensor 'w': shape (3, 2)"),
            ({"w": torch.zeros(2, 2, dtype=torch.float16)}, "tensor 'w': dtype INT32"),
        ]
        for state, text in bad:
            msgs = list(stream(state))
            if "INT32" in text:
                msgs[0].chunk.dtype = common_pb2.DTYPE_INT32
            with pytest.raises(aio.AioRpcError) as info:
                await stub.UpdateWeights(iter(msgs))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in (info.value.details() or "")
        assert backend.policy_version == 7 and torch.equal(backend.weights["w"], (new * 2).float())  # nothing applied
        (r,) = [x async for x in stub.Generate(gen_request([prompt(tok, "hi")]))]
        assert r.sample.policy_version == 7
        info = await stub.GetInfo(rollout_pb2.GetInfoRequest())
    assert info.policy_version == 7 and info.backend == "scripted" and "calculator" in info.tools


async def test_a_refused_update_still_names_the_tensor_while_the_client_is_sending(tok: Any) -> None:
    """The first chunk is refused while hundreds more are on their way: the client must hear INVALID_ARGUMENT
    naming the tensor, not the failed write of its next chunk (grpc.aio's INTERNAL SendMessageOperation)."""
    backend = ScriptedBackend(tok, timed_script)
    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        for _ in range(5):
            raw = iter_update_requests({"nope": torch.zeros(1024, 1024)}, 0, chunk_bytes=16384)
            with pytest.raises(aio.AioRpcError) as info:
                await stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest.FromString(r) for r in raw)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "unknown tensor 'nope'" in (info.value.details() or "")
        assert backend.policy_version == 0


def test_partial_chunks_are_rejected() -> None:
    from rewardmesh.common.planes.grpc_chunks import WeightAssembler

    asm = WeightAssembler({"w": ((4,), torch.float32)})
    msgs = [rollout_pb2.UpdateWeightsRequest.FromString(b) for b in iter_update_requests({"w": torch.ones(4)}, 0, 4)]
    for m in msgs[:-1]:
        asm.add(m.chunk)
    with pytest.raises(ValueError, match="got 12 of 16 bytes"):
        asm.finish()
    assert np.frombuffer(msgs[0].chunk.data, "<f4")[0] == 1.0


async def test_logprobs_and_token_versions_travel_on_the_sample(tok: Any) -> None:
    backend = ScriptedBackend(tok, timed_script)
    backend.policy_version = 2
    async with rollout_server(backend, []) as ro, rollout_stub(ro.address) as stub:
        request = gen_request([prompt(tok, "hi")], n=2)
        request.sampling.logprobs = True
        asked = [r async for r in stub.Generate(request)]
        plain = [r async for r in stub.Generate(gen_request([prompt(tok, "hi")]))]
    for r in asked:
        n = len(ids_from(r.sample.response_ids, "r"))
        logprobs = tensor_to_numpy(r.sample.response_logprobs, "lp", dtype=common_pb2.DTYPE_FLOAT32, ndim=1)
        versions = tensor_to_numpy(r.sample.response_policy_versions, "v", dtype=common_pb2.DTYPE_INT64, ndim=1)
        assert logprobs.tolist() == pytest.approx([-0.1] * n) and versions.tolist() == [2] * n
    assert not plain[0].sample.HasField("response_logprobs") and plain[0].sample.HasField("response_policy_versions")
