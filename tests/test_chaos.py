"""Chaos with real processes: servers killed and restarted during a multi-step run, abandoned streams, slow
readers and connection churn. Fixed seed; bounded in time."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc import aio

from rewardmesh.client.batch import ScoredSample
from rewardmesh.client.trainer import PromptSpec, Sampling, TrainerClient
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2
from tests.support.ports import free_port
from tests.support.servers import FNS, sample
from tests.support.waiting import eventually

CLI = [sys.executable, "-m", "rewardmesh.server.cli"]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


class Restartable:
    """A server process on a fixed port, so clients find it again after a restart."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.name, self.argv, self.log_dir = name, argv, log_dir
        self.proc: ServerProcess | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        argv = [*self.argv, "--host", "127.0.0.1", "--port", str(self.port), "--grace-s", "2"]
        self.proc = ServerProcess(f"{self.name}-{self.starts}", argv, self.log_dir)
        self.proc.start(timeout_s=120)

    def kill(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if sig == signal.SIGKILL:
            self.proc.kill()
        else:
            self.proc.stop(timeout_s=30)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def _policy_state(tiny_models: TinyModelPaths) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(tiny_models.policy / "model.safetensors"))
    if "lm_head.weight" not in state:  # tied to the embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@pytest.mark.timeout(900)  # a hang guard only: six server starts take minutes on a machine loaded many times over
async def test_servers_killed_and_restarted_mid_run_every_step_completes_nothing_twice(
    tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    """Five steps, new weights after each. Each kill lands mid-step, right after the k-th of the step's 12 samples
    arrived (k from a fixed seed): the reward server SIGKILLed, one rollout server SIGTERMed (a drain) in the same
    step, the other SIGKILLed two steps later, each restarted on its port in the background while the run goes on.
    A restarted rollout server must be brought to the current weights before it serves: every sample is on the
    current policy version (a step's samples all come after the previous step's update)."""
    rng = random.Random(17)
    # first_number beside a source that waits extra_info['delay'] (weight 0): groups finish 0.2 s apart, so when
    # a kill lands the later groups are still in flight on both rollout servers and on the reward server.
    config = tmp_path / "reward.yaml"
    config.write_text(
        "pipelines:\n  slow_first_number:\n    sources:\n      - {type: rule, rule: first_number}\n"
        f"      - {{type: function, function: '{FNS}:sleepy', weight: 0.0, timeout_s: 30}}\n"
    )
    reward = Restartable("reward", [*CLI, "serve", "reward", "--config", str(config)], tmp_path)
    rollout_argv = [*CLI, "serve", "rollout", "--backend", "hf", "--model", str(tiny_models.policy)]
    rollouts = [
        Restartable(f"rollout{i}", [*rollout_argv, "--reward-target", reward.address], tmp_path) for i in range(2)
    ]
    # The two rollout servers are never down together (a group that finds no server gives up after its attempts).
    plan = {1: [(reward, signal.SIGKILL), (rollouts[0], signal.SIGTERM)], 3: [(rollouts[1], signal.SIGKILL)]}
    restarts: dict[str, asyncio.Task[None]] = {}
    state = _policy_state(tiny_models)
    try:
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in [reward, *rollouts]))
        prompts = [PromptSpec(messages=[{"role": "user", "content": f"{i} + 1 ="}], ground_truth=str(i + 1),
                              extra_info={"delay": 0.2 * i}) for i in range(6)]  # fmt: skip
        async with TrainerClient([r.address for r in rollouts], reward="slow_first_number", retry_backoff_s=0.1,
                                 sampling=Sampling(max_tokens=8), generate_timeout_s=120) as client:  # fmt: skip
            await client.update_weights(state, transport="grpc")
            trained: set[str] = set()
            for step in range(5):
                if step == 3:  # rollout0 is back, and the client's channel to it reconnected, before rollout1 goes down
                    await restarts.pop(rollouts[0].name)
                    (back,) = [t for t in client.targets if t.address == rollouts[0].address]
                    await back.stub.GetInfo(rollout_pb2.GetInfoRequest(), wait_for_ready=True, timeout=60)
                kills = [(victim, sig, rng.randint(1, 6)) for victim, sig in plan.get(step, [])]
                killed: list[asyncio.Task[None]] = []
                got: list[ScoredSample] = []
                async for s in client.rollout(prompts, n=2):
                    got.append(s)
                    for victim, sig, after in kills:
                        if after == len(got):  # mid-step: the other samples are generating or being scored
                            killed.append(asyncio.create_task(asyncio.to_thread(victim.kill, sig)))
                            restarts[victim.name] = asyncio.create_task(_restart_after(killed[-1], victim))
                await asyncio.gather(*killed)  # dead before the update: it must catch up when it comes back
                ids = [s.sample_id for s in got]
                assert len(ids) == 12 and len(set(ids)) == 12, f"step {step}: {len(ids)} samples, {len(set(ids))} ids"
                assert not trained & set(ids), f"step {step}: samples trained twice"
                trained |= set(ids)
                for s in got:  # answered once, scored or reported failed (never trained as a 0)
                    assert s.failed or s.score in (0.0, 0.1, 1.0), (step, s.sample_id, s.score)
                    assert s.failed or s.policy_version == client.policy_version, (step, s.policy_version)
                await client.update_weights(state, transport="grpc")
            assert len(trained) == 12 * 5
            await asyncio.gather(*restarts.values())
            assert [server.starts for server in [reward, *rollouts]] == [2, 2, 2]
    finally:
        for task in restarts.values():
            task.cancel()
        for server in [*rollouts, reward]:
            server.close()


async def _restart_after(killed: asyncio.Task[None], server: Restartable) -> None:
    await killed
    await asyncio.to_thread(server.start)


@asynccontextmanager
async def reward_process(tmp_path: Path) -> AsyncIterator[ServerProcess]:
    server = ServerProcess("reward", [*CLI, "serve", "reward", "--host", "127.0.0.1", "--port", "0"], tmp_path)
    server.start(timeout_s=120)
    try:
        yield server
    finally:
        server.kill()


async def _bystander(stub: Any) -> None:
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("by")]), timeout=30)
    assert reply.results[0].score == 1.0


@pytest.mark.timeout(240)
async def test_abandoned_streams_slow_readers_and_connection_churn_leave_memory_bounded(tmp_path: Path) -> None:
    async with reward_process(tmp_path) as server, aio.insecure_channel(server.address) as channel:
        stub: Any = reward_pb2_grpc.RewardServiceStub(channel)
        await _bystander(stub)

        async def abandon(count: int, tag: str) -> None:
            """Open `count` Score streams, send one sample on each, then drop them all unread."""
            calls = []
            for i in range(count):
                call = stub.Score()
                await call.write(reward_pb2.ScoreRequest(sample=sample(f"{tag}-{i}"), reward="gsm8k"))
                calls.append(call)
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.5)  # pacing only: every bound below is waited for, not assumed

        await abandon(200, "warm")  # allocator and gRPC pools reach their working size
        base_rss, base_fds = _rss_mb(server.pid), _fds(server.pid)
        for round_ in range(4):
            await abandon(500, f"r{round_}")
        await _bystander(stub)
        # Bounds reached eventually: a loaded machine may take a while to reap 2,000 cancelled streams.
        await eventually(lambda: _rss_mb(server.pid) < base_rss + 60, f"RSS back under {base_rss:.0f} + 60 MB")

        # A slow reader: writes 3,000 samples, reads one result a second; the server stops reading it at its
        # bound (flow control) and keeps serving everyone else.
        slow = stub.Score()

        written = [0, -1]  # writes done; writes done when last looked at

        async def write_all() -> None:
            for i in range(3000):
                await slow.write(reward_pb2.ScoreRequest(sample=sample(f"slow-{i}"), reward="gsm8k"))
                written[0] += 1

        def held() -> bool:
            """No write went through since the last look: the writer waits on the server's bound (or is done)."""
            stalled, written[1] = written[0] == written[1], written[0]
            return stalled or writer.done()

        writer = asyncio.create_task(write_all())
        await eventually(held, "the slow reader's writer held at the server's bound", every_s=0.5)
        await _bystander(stub)
        slow.cancel()
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)

        # Connection churn: 150 short-lived connections, one call each.
        for i in range(150):
            async with aio.insecure_channel(server.address) as short:
                await reward_pb2_grpc.RewardServiceStub(short).ScoreBatch(
                    reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample(f"churn-{i}")]), timeout=30
                )
        await _bystander(stub)
        await eventually(lambda: _fds(server.pid) < base_fds + 20, f"fds back under {base_fds} + 20")
        await eventually(lambda: _rss_mb(server.pid) < base_rss + 80, f"RSS back under {base_rss:.0f} + 80 MB")


async def _step(client: TrainerClient, prompts: list[PromptSpec]) -> list[ScoredSample]:
    """One step's samples (every wait bounded: a hang fails the test)."""
    return await asyncio.wait_for(_collect(client.rollout(prompts, n=2)), 240)


async def _collect(samples: AsyncIterator[ScoredSample]) -> list[ScoredSample]:
    return [s async for s in samples]


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_too_deep_sample_and_ids_reused_by_another_client_break_nobody_elses_step(
    tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    """A reward server and two rollout servers as real processes, two trainers on them at once, both naming
    their groups q0..q3 (so their sample ids collide on every server). Trainer A also sends a prompt whose
    extra_info is one level past the depth limit, and one exactly at it. The deep one's samples fail alone
    (INVALID_ARGUMENT naming the field); every other sample of both trainers is scored with its own result
    (the score is the sample's ground truth: 1 for A, 2 for B), and B's step completes (each step bounded)."""
    config = tmp_path / "reward.yaml"
    config.write_text(
        f"pipelines:\n  truth:\n    sources:\n      - {{type: function, function: '{FNS}:truth_as_score'}}\n"
    )
    reward = Restartable("reward", [*CLI, "serve", "reward", "--config", str(config)], tmp_path)
    rollout_argv = [*CLI, "serve", "rollout", "--backend", "hf", "--model", str(tiny_models.policy)]
    rollouts = [
        Restartable(f"rollout{i}", [*rollout_argv, "--reward-target", reward.address], tmp_path) for i in range(2)
    ]

    def prompts(truth: str, count: int = 4) -> list[PromptSpec]:
        return [PromptSpec(messages=[{"role": "user", "content": f"{i} + {truth} ="}], ground_truth=truth,
                           group_id=f"q{i}") for i in range(count)]  # fmt: skip

    try:
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in [reward, *rollouts]))
        targets = [r.address for r in rollouts]
        options: dict[str, Any] = {"reward": "truth", "sampling": Sampling(max_tokens=8), "generate_timeout_s": 180}
        async with TrainerClient(targets, **options) as a, TrainerClient(targets, **options) as b:
            alone = await _step(b, prompts("2"))
            assert all(not s.failed and s.score == 2.0 for s in alone)
            deep = [
                PromptSpec(
                    messages=[{"role": "user", "content": "deep"}],
                    ground_truth="1",
                    group_id=f"deep{n}",
                    extra_info={"nested": _nested(n - 1)},
                )
                for n in (32, 33)  # extra_info's own level plus n - 1 below it
            ]
            mine, theirs = await asyncio.gather(_step(a, [*prompts("1"), *deep]), _step(b, prompts("2")))
        by_group: dict[str, list[ScoredSample]] = {}
        for s in mine:
            by_group.setdefault(s.group_id, []).append(s)
        assert sorted(by_group) == ["deep32", "deep33", "q0", "q1", "q2", "q3"]
        assert all(len(group) == 2 for group in by_group.values())
        for s in by_group.pop("deep33"):
            assert s.failed and s.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], s.error
            assert "prompts[0].extra_info nesting depth is 33" in s.error and "max_extra_info_depth" in s.error
        assert all(not s.failed and s.score == 1.0 for group in by_group.values() for s in group)
        assert len(theirs) == 8 and all(not s.failed and s.score == 2.0 for s in theirs)
        assert len({s.sample_id for s in theirs}) == 8
    finally:
        for server in [*rollouts, reward]:
            server.close()
