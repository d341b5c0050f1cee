"""Generate's message path over real gRPC on 127.0.0.1: several samples per message, bounded work per call,
and the trainer's end-to-end deadline on a Generate call."""

from __future__ import annotations

from typing import Any

import grpc

from rewardmesh.client.trainer import PromptSpec, TrainerClient
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.v1 import rollout_pb2
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import reward_server, rollout_server, rollout_stub
from tests.support.waiting import eventually, holds_for


def instant(text: str, turn: int) -> tuple[str, float]:
    return "#### 4", 0.0


def forever(text: str, turn: int) -> tuple[str, float]:
    return "#### 4", 30.0


def request(tok: Any, n: int, **kw: Any) -> rollout_pb2.GenerateRequest:
    p = rollout_pb2.Prompt(group_id="g", token_ids=ids_tensor(tok.encode("2 + 2 =")), ground_truth="4")
    return rollout_pb2.GenerateRequest(prompts=[p], n=n, sampling=rollout_pb2.SamplingParams(max_tokens=8), **kw)


async def test_samples_that_finish_together_share_a_message(tok: Any) -> None:
    async with reward_server() as rs, rollout_server(ScriptedBackend(tok, instant), [rs.address]) as ro:
        async with rollout_stub(ro.address) as stub:
            messages = [m async for m in stub.Generate(request(tok, 16, reward="gsm8k", max_samples_per_message=8))]
            old_style = [m async for m in stub.Generate(request(tok, 4, reward="gsm8k"))]
    samples = [item for m in messages for item in (m.items or [m])]
    assert sorted(s.sample.sample_id for s in samples) == sorted(f"g/{k}" for k in range(16))
    assert all(s.result.score == 1.0 and not s.result.HasField("error") for s in samples)
    assert len(messages) < 16 and all(len(m.items) <= 8 for m in messages)
    assert all(not m.items and m.HasField("sample") for m in old_style)  # one per message stays the default
    assert len(old_style) == 4


async def test_a_call_runs_at_most_its_bound_of_samples_at_once(tok: Any) -> None:
    backend = ScriptedBackend(tok, forever)
    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        ro.servicer.max_call_unsent = 3
        call = stub.Generate(request(tok, 50))
        await eventually(lambda: len(backend.requests) >= 3, "three samples generating")
        # The other 47 wait until the client has taken some.
        await holds_for(lambda: len(backend.requests) == 3, "no more than the bound of samples at once")
        call.cancel()
        await eventually(lambda: not backend.running, "the cancelled call's samples stop")


async def test_a_call_starts_whole_prompt_groups_within_its_bound(tok: Any) -> None:
    """Bound 6, groups of 4: one group starts (one engine request where the backend groups), the next waits until
    it fits whole rather than starting half of it."""
    backend = ScriptedBackend(tok, forever)
    async with rollout_server(backend) as ro, rollout_stub(ro.address) as stub:
        ro.servicer.max_call_unsent = 6
        prompts = [rollout_pb2.Prompt(group_id=f"g{i}", token_ids=ids_tensor(tok.encode("2 + 2 ="))) for i in range(3)]
        call = stub.Generate(rollout_pb2.GenerateRequest(prompts=prompts, n=4))
        await eventually(lambda: len(backend.requests) >= 4, "the first group generating")
        await holds_for(lambda: len(backend.requests) == 4, "the second group waits for room for all four")
        call.cancel()
        await eventually(lambda: not backend.running, "the cancelled call's samples stop")


async def test_a_generate_call_past_its_deadline_fails_its_samples_not_the_step(tok: Any) -> None:
    # Every wait on the client side has a deadline.
    async with rollout_server(ScriptedBackend(tok, forever)) as ro:
        async with TrainerClient([ro.address], generate_timeout_s=0.5) as client:
            got = [s async for s in client.rollout([PromptSpec(token_ids=tok.encode("2 + 2 ="))], n=3)]
    assert len(got) == 3 and all(s.failed for s in got)
    assert {s.error_code for s in got} == {grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}
