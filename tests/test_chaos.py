"""Chaos with real processes: servers killed and restarted during a multi-step run, abandoned streams, slow
readers and connection churn. Fixed seed; bounded in time."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from grpc import aio

from client.trainer import PromptSpec, Sampling, TrainerClient
from demo.server_process import ServerProcess
from demo.tiny_models import TinyModelPaths
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.servers import sample

CLI = [sys.executable, "-m", "server.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.port = _free_port()
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


@pytest.mark.timeout(300)
async def test_servers_killed_and_restarted_mid_run_every_step_completes_nothing_twice(
    tiny_models: TinyModelPaths, tmp_path: Path
) -> None:
    rng = random.Random(17)
    reward = Restartable("reward", [*CLI, "serve", "reward"], tmp_path)
    rollout_argv = [*CLI, "serve", "rollout", "--backend", "hf", "--model", str(tiny_models.policy)]
    rollouts = [
        Restartable(f"rollout{i}", [*rollout_argv, "--reward-target", reward.address], tmp_path) for i in range(2)
    ]
    # Each kind of server killed at least once, with SIGKILL and with SIGTERM (a drain).
    plan = [(reward, signal.SIGKILL), (rollouts[0], signal.SIGTERM), (rollouts[1], signal.SIGKILL)]
    try:
        for server in [reward, *rollouts]:
            server.start()
        prompts = [PromptSpec(messages=[{"role": "user", "content": f"{i} + 1 ="}], ground_truth=str(i + 1))
                   for i in range(6)]  # fmt: skip
        async with TrainerClient([r.address for r in rollouts], reward="first_number", retry_backoff_s=0.1,
                                 sampling=Sampling(max_tokens=8), generate_timeout_s=120) as client:  # fmt: skip
            trained: set[str] = set()
            for step, (victim, sig) in enumerate([(None, None), *plan]):

                async def chaos(victim: Restartable | None = victim, sig: signal.Signals | None = sig) -> None:
                    if victim is None or sig is None:
                        return
                    await asyncio.sleep(rng.uniform(0.0, 0.6))
                    await asyncio.to_thread(victim.kill, sig)
                    await asyncio.to_thread(victim.start)

                chaos_task = asyncio.create_task(chaos())
                batch = await client.generate_batch(prompts, n=2)
                await chaos_task
                ids = batch.sample_ids
                assert len(ids) == 12 and len(set(ids)) == 12, f"step {step}: {len(ids)} samples, {len(set(ids))} ids"
                assert not trained & set(ids), f"step {step}: samples trained twice"
                trained |= set(ids)
                for s in batch.samples:  # answered once, scored or reported failed (never trained as a 0)
                    assert s.error or s.score in (0.0, 0.1, 1.0)
            assert len(trained) == 12 * (len(plan) + 1)
    finally:
        for server in [*rollouts, reward]:
            server.close()


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
            await asyncio.sleep(0.5)

        await abandon(200, "warm")  # allocator and gRPC pools reach their working size
        base_rss, base_fds = _rss_mb(server.pid), _fds(server.pid)
        for round_ in range(4):
            await abandon(500, f"r{round_}")
        await _bystander(stub)
        assert _rss_mb(server.pid) < base_rss + 60, (base_rss, _rss_mb(server.pid))

        # A slow reader: writes 3,000 samples, reads one result a second; the server stops reading it at its
        # bound (flow control) and keeps serving everyone else.
        slow = stub.Score()

        async def write_all() -> None:
            for i in range(3000):
                await slow.write(reward_pb2.ScoreRequest(sample=sample(f"slow-{i}"), reward="gsm8k"))

        writer = asyncio.create_task(write_all())
        await asyncio.sleep(1.0)
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
        await asyncio.sleep(1.0)
        await _bystander(stub)
        assert _fds(server.pid) < base_fds + 20, (base_fds, _fds(server.pid))
        assert _rss_mb(server.pid) < base_rss + 80, (base_rss, _rss_mb(server.pid))
