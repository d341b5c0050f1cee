"""TrainerClient and batches: layout on known ids, metrics, GRPO, mini-batches, off-policy bound, failover, weights."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from rewardmesh.client.batch import ScoredSample, assemble_batch, compute_metrics, grpo_advantages
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient, reward_overlap
from rewardmesh.demo.tiny_models import TinyModelPaths
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import reward_server, rollout_server
from tests.support.waiting import eventually, holds_for


def scored(sid: str, group: str, prompt: list[int], response: list[int], score: float, **timing: float) -> ScoredSample:
    t = {"generate_sequences": 0.0, "tool_calls": 0.0, "reward": 0.0, "reward_queue": 0.0, "reward_compute": 0.0,
         "num_preempted": 0.0, "num_turns": 1.0, "prompt_length": float(len(prompt)),
         "response_length": float(len(response)), **timing}  # fmt: skip
    return ScoredSample(sid, group, np.array(prompt, np.int32), np.array(response, np.int32),
                        np.ones(len(response), np.int32), score, {"acc": score}, t, 0)  # fmt: skip


def test_batch_layout_on_known_token_ids() -> None:
    a = scored("a", "g", [5, 6, 7], [8, 9], 1.0)
    b = scored("b", "g", [4], [1, 2, 3, 4], 0.5)
    b.response_mask = np.array([1, 0, 0, 1], np.int32)  # tool output in the middle
    batch = assemble_batch([a, b], pad_token_id=0)
    assert batch.prompts.tolist() == [[5, 6, 7], [0, 0, 4]]  # left-padded
    assert batch.responses.tolist() == [[8, 9, 0, 0], [1, 2, 3, 4]]  # right-padded
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0], [0, 0, 4, 1, 2, 3, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1]]
    assert batch.token_level_scores.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]
    assert batch.extras["acc"].tolist() == [1.0, 0.5] and batch.group_ids == ["g", "g"]


def test_grpo_advantages_by_hand() -> None:
    scores = [1.0, 0.0, 0.0, 1.0]
    std = statistics.stdev(scores)  # unbiased, as torch.std in verl
    assert grpo_advantages(scores) == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert grpo_advantages([2.0, 2.0, 2.0]) == pytest.approx([0.0, 0.0, 0.0])
    assert grpo_advantages([3.0, 1.0], normalize_std=False) == [1.0, -1.0]
    assert grpo_advantages([0.7]) == [0.7]


def test_metrics_names_values_and_the_slowest_sample() -> None:
    samples = [
        scored("fast", "g", [1], [2], 1.0, generate_sequences=1.0, reward=0.5, reward_queue=0.1, reward_compute=0.3),
        scored(
            "slow", "g", [1, 2], [2, 3, 4], 0.0, generate_sequences=2.0, tool_calls=1.5, reward=0.2, num_preempted=3
        ),
        scored("rewardy", "g", [1], [2], 0.5, generate_sequences=0.5, reward=2.9),
    ]
    m = compute_metrics(samples, gen_seconds=4.2)
    assert m["timing_s/agent_loop/generate_sequences/max"] == 2.0
    assert m["timing_s/agent_loop/generate_sequences/mean"] == pytest.approx(3.5 / 3)
    assert m["timing_s/agent_loop/reward/min"] == 0.2 and m["timing_s/agent_loop/reward_queue/max"] == 0.1
    assert m["timing_s/agent_loop/tool_calls/max"] == 1.5 and m["timing_s/agent_loop/num_preempted/max"] == 3
    # slowest = largest generate + tool + reward: "slow" (3.7) beats "rewardy" (3.4) and "fast" (1.5)
    assert m["timing_s/agent_loop/slowest/generate_sequences"] == 2.0
    assert m["timing_s/agent_loop/slowest/tool_calls"] == 1.5
    assert m["timing_s/agent_loop/slowest/reward"] == 0.2
    assert m["timing_s/agent_loop/slowest/num_preempted"] == 3
    assert m["timing_s/agent_loop/slowest/prompt_length"] == 2 and m["timing_s/agent_loop/slowest/response_length"] == 3
    assert m["critic/score/mean"] == pytest.approx(0.5) and m["critic/score/max"] == 1.0
    assert m["response_length/max"] == 3 and m["reward_extra/acc/mean"] == pytest.approx(0.5)
    assert m["timing_s/gen"] == 4.2


def test_reward_overlap_splits_hidden_and_exposed() -> None:
    a = scored("a", "g", [1], [2], 0, reward=1.0)
    a.arrived = 2.0  # generated at 1.0, scored 1.0..2.0
    b = scored("b", "g", [1], [2], 0, reward=1.0)
    b.arrived = 4.0  # generated at 3.0 (last), scored 3.0..4.0: one second exposed
    m = reward_overlap([a, b], 4.0)
    assert m["timing_s/reward_exposed"] == pytest.approx(1.0) and m["timing_s/reward_hidden"] == pytest.approx(1.0)


def wait_script(text: str, turn: int) -> tuple[str, float]:
    seconds = float(text.split("wait ")[1].split()[0]) if "wait " in text else 0.0
    return "#### 4", seconds


def prompts(tok: Any, count: int, wait: float = 0.0) -> list[PromptSpec]:
    return [PromptSpec(token_ids=tok.encode(f"q{i} wait {wait * (i % 3):.2f}"), ground_truth="4" if i % 2 else "5",
                       data_source="openai/gsm8k") for i in range(count)]  # fmt: skip


async def test_generate_batch_end_to_end_over_two_rollout_servers(tok: Any) -> None:
    b1, b2 = ScriptedBackend(tok, wait_script), ScriptedBackend(tok, wait_script)
    async with reward_server() as rs, rollout_server(b1, [rs.address]) as r1, rollout_server(b2, [rs.address]) as r2:
        async with TrainerClient([r1.address, r2.address], reward="gsm8k", sampling=Sampling(max_tokens=32)) as client:
            batch = await client.generate_batch(prompts(tok, 6, 0.05), n=4)
    assert len(batch) == 24 and len(set(batch.sample_ids)) == 24
    assert (
        sorted(set(batch.group_ids)) == sorted({s.group_id for s in batch.samples}) and len(set(batch.group_ids)) == 6
    )
    for s in batch.samples:  # truth alternates 5/4, the script always answers 4
        assert s.score == (1.0 if s.sample_id.split("-")[-1].split("/")[0] in {"1", "3", "5"} else 0.0)
    # Each group's advantages are its scores normalised: here every group is uniform, so all zero.
    assert torch.allclose(batch.advantages, torch.zeros(24))
    m = batch.metrics
    assert m["critic/score/mean"] == pytest.approx(0.5) and m["timing_s/gen"] > 0
    assert m["timing_s/agent_loop/reward/max"] == pytest.approx(max(s.timing["reward"] for s in batch.samples))
    assert r1.worker.running_samples == 0 and b1.requests and b2.requests  # both servers used


async def test_minibatches_hold_only_complete_groups_and_come_early(tok: Any) -> None:
    async with reward_server() as rs, rollout_server(ScriptedBackend(tok, wait_script), [rs.address]) as r1:
        async with TrainerClient([r1.address], reward="gsm8k") as client:
            got = []
            # Groups wait 0, 0.5 and 1 s: the spread dwarfs the overhead a loaded machine adds to every group.
            async for mb in client.stream_minibatches(prompts(tok, 6, 0.5), n=3, minibatch_size=6):
                got.append((mb, mb.metrics["timing_s/gen"]))
    assert [len(mb) for mb, _ in got] == [6, 6, 6]
    for mb, _ in got:
        groups: dict[str, int] = {}
        for g in mb.group_ids:
            groups[g] = groups.get(g, 0) + 1
        assert set(groups.values()) == {3}  # whole groups only
    assert got[-1][1] >= 1.0  # the slowest groups waited 1 s (a lower bound)
    assert got[0][1] < got[-1][1] - 0.1  # the first mini-batch was ready well before the slowest sample


async def test_one_step_off_policy_starts_the_next_step_before_handing_out_this_one(tok: Any) -> None:
    backend = ScriptedBackend(tok, wait_script)
    async with reward_server() as rs, rollout_server(backend, [rs.address]) as r1:
        async with TrainerClient([r1.address], reward="gsm8k") as client:
            steps = [prompts(tok, 2, 0.05) for _ in range(4)]
            handed = 0
            async for batch in client.batches(steps, n=2, off_policy_steps=1):
                # step k+1's groups are already running when step k is handed out ...
                assert client.groups_started == min(handed + 2, 4) * 2
                assert all(s.policy_version >= client.policy_version - 1 for s in batch.samples)
                # ... so while the trainer trains, they reach the rollout server
                expected = min(handed + 2, 4) * 4

                def arrived(n: int = expected) -> bool:
                    return len(backend.requests) >= n

                await eventually(arrived, "the next step's requests arrive")
                assert len(backend.requests) == expected
                handed += 1
                await client.update_weights({"w": torch.full((2, 2), float(handed))})
    assert handed == 4 and client.dropped_stale_samples == 0


async def test_synchronous_mode_waits_for_the_trainer(tok: Any) -> None:
    backend = ScriptedBackend(tok, wait_script)
    async with reward_server() as rs, rollout_server(backend, [rs.address]) as r1:
        async with TrainerClient([r1.address], reward="gsm8k") as client:
            handed = 0
            async for batch in client.batches([prompts(tok, 2) for _ in range(3)], n=2, off_policy_steps=0):
                # Nothing of the next step starts while the trainer holds this batch.
                groups = (handed + 1) * 2
                await holds_for(
                    lambda g=groups: len(backend.requests) == g * 2 and client.groups_started == g,  # type: ignore[misc]
                    "no rollout ahead of the trainer",
                )
                assert {s.policy_version for s in batch.samples} == {handed}  # always on-policy
                handed += 1
                await client.update_weights({"w": torch.full((2, 2), float(handed))})
    assert handed == 3


async def test_samples_beyond_the_staleness_bound_are_never_handed_out(tok: Any) -> None:
    backend = ScriptedBackend(tok, wait_script)
    async with reward_server() as rs, rollout_server(backend, [rs.address]) as r1:
        async with TrainerClient([r1.address], reward="gsm8k") as client:
            handed = []
            async for batch in client.batches([prompts(tok, 2, 0.05) for _ in range(4)], n=2, off_policy_steps=1):
                handed += [client.policy_version - s.policy_version for s in batch.samples]
                for _ in range(2):  # two versions per step: the prefetched step falls 2 behind
                    await client.update_weights({"w": torch.zeros(2, 2)})
    assert client.dropped_stale_samples > 0
    assert all(staleness <= 1 for staleness in handed)


async def test_rollout_server_killed_mid_step_loses_nothing(tok: Any) -> None:
    async with reward_server() as rs, rollout_server(ScriptedBackend(tok, wait_script), [rs.address]) as r1, \
            rollout_server(ScriptedBackend(tok, wait_script), [rs.address]) as r2:  # fmt: skip
        async with TrainerClient([r1.address, r2.address], reward="gsm8k", retry_backoff_s=0.05) as client:

            async def kill() -> None:  # while r1 is generating: its samples must be sent again elsewhere
                await eventually(lambda: r1.worker.running_samples > 0, "r1 is generating")
                await r1.grpc.server.stop(0)

            killer = asyncio.create_task(kill())
            batch = await client.generate_batch(prompts(tok, 8, 0.25), n=2)
            await killer
            assert client.resent_samples > 0
    assert len(batch) == 16 and len(set(batch.sample_ids)) == 16
    assert all(not s.error for s in batch.samples)


async def test_weight_sync_reaches_every_server(tok: Any) -> None:
    b1, b2 = ScriptedBackend(tok, wait_script), ScriptedBackend(tok, wait_script)
    async with rollout_server(b1) as r1, rollout_server(b2) as r2:
        async with TrainerClient([r1.address, r2.address]) as client:
            version = await client.update_weights({"w": torch.ones(2, 2, dtype=torch.bfloat16)})
            infos = await client.info()
    assert version == 1 and [i.policy_version for i in infos] == [1, 1]
    assert torch.equal(b1.weights["w"], torch.ones(2, 2)) and torch.equal(b2.weights["w"], torch.ones(2, 2))


@pytest.mark.timeout(240)
async def test_short_demo_run_trains_and_plots(tiny_models: TinyModelPaths, tmp_path: Path) -> None:
    from rewardmesh.demo.rl_demo import run_demo
    from rewardmesh.server.cli import build_parser

    flags = ["--steps", "3", "--prompts-per-step", "8", "--n", "4", "--models", str(tiny_models.root),
             "--max-batch-size", "32", "--plot", str(tmp_path / "curve.png"),
             "--metrics-out", str(tmp_path / "m.json")]  # fmt: skip
    args = build_parser().parse_args(["demo", *flags])
    assert await run_demo(args) == 0
    assert (tmp_path / "curve.png").stat().st_size > 1000
    import json

    history = json.loads((tmp_path / "m.json").read_text())
    assert len(history) == 3 and all("actor/pg_loss" in h and h["gen_s"] > 0 for h in history)
    # one-step off-policy by default: every update was corrected against the rollout log-probs
    assert all("actor/ppo_kl" in h and "training/rollout_probs_diff_max" in h for h in history)


async def test_a_call_that_fails_after_its_last_sample_is_not_sent_again(tok: Any) -> None:
    """A rollout server killed after it sent a group's last sample but before the call's OK: the call ends
    UNAVAILABLE with nothing left to ask for. It was re-sent with n = 0 (refused INVALID_ARGUMENT: the step
    failed, found by the chaos test); now the group is complete and nothing is sent again."""
    from grpc import aio

    from rewardmesh.common.tensors import ids_tensor
    from rewardmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

    calls: list[rollout_pb2.GenerateRequest] = []
    first_failed = asyncio.Event()

    class AllThenUnavailable(rollout_pb2_grpc.RolloutServiceServicer):
        async def Generate(self, request: Any, context: Any) -> Any:
            calls.append(request)
            if request.n < 1:  # as the real server answers it
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n must be >= 1, got {request.n}")
            last = request.prompts[0].group_id.endswith("-0")  # the first group: killed after its last sample
            if not last:  # the other group is still running when the first one's call fails
                await asyncio.wait_for(first_failed.wait(), 60)
            for k in range(request.n):
                sid = request.prompts[0].sample_ids[k]
                sample = common_pb2.Sample(sample_id=sid, group_id=request.prompts[0].group_id,
                                           prompt_ids=ids_tensor([1]), response_ids=ids_tensor([2]))  # fmt: skip
                yield rollout_pb2.GenerateResponse(sample=sample, result=reward_pb2.RewardResult(sample_id=sid))
            if last:
                try:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "killed before the call's end")
                finally:
                    first_failed.set()

    server = aio.server()
    only_generate: Any = AllThenUnavailable  # the other methods are never called here
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(only_generate(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with TrainerClient([f"127.0.0.1:{port}"], retry_backoff_s=0.01) as client:
            got = [s async for s in client.rollout(prompts(tok, 2), n=3)]
    finally:
        await server.stop(None)
    assert sorted(s.sample_id for s in got) == sorted(f"{g}/{k}" for g in {s.group_id for s in got} for k in range(3))
    assert len(got) == 6 and not any(s.failed for s in got)
    assert [c.n for c in calls] == [3, 3]  # one call per group, none re-sent
