"""Untrusted parsing runs isolated: a hostile answer costs its own sample its budget, nobody else anything.

The regression test runs `rewardmesh serve reward` as a real process and scores, with the built-in `math`
rule (math-verify), an answer that keeps sympy busy for hours: ``\\boxed{9^{9^{9}}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest

from rewardmesh.common.errors import DeadlineExceeded, SourceFailed
from rewardmesh.demo.server_process import ServerProcess
from rewardmesh.reward_engine.isolation import Call, IsolatedPool
from rewardmesh.reward_engine.sources.rules import RuleSource
from rewardmesh.reward_engine.types import RewardInput, RewardOutput
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.paths import CLI
from tests.support.servers import sample
from tests.support.waiting import eventually, wait_until

HOSTILE = r"The answer is \boxed{9^{9^{9}}}"


def _children(pid: int) -> set[int]:
    """PIDs whose parent is ``pid`` (from /proc: no psutil needed)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _cpu_s(pids: set[int]) -> float:
    """CPU seconds the processes have used (utime + stime from /proc)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_busy(server_pid: int, what: str) -> None:
    """Until the server's worker processes burn CPU on the hostile sample: it is being scored, not in transit
    (a fixed sleep proves neither on a loaded machine, and a sample that has not arrived before a SIGTERM
    would be refused as draining)."""
    base = _cpu_s(_children(server_pid))
    wait_until(lambda: _cpu_s(_children(server_pid)) > base + 0.2, what)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_hostile_math_answer_does_not_delay_a_bystander_and_sigterm_exits_within_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grace_s = 30
    monkeypatch.setenv("REWARDMESH_RULE_TIMEOUT_S", "5")  # the bystander's margin on a loaded machine
    monkeypatch.setenv("REWARDMESH_GRACE_S", str(grace_s))
    server = ServerProcess("reward", [*CLI, "serve", "reward", "--port", "0", "--host", "127.0.0.1"], tmp_path)
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            # Workers start (and import math-verify) on first use: not charged to any sample's budget.
            warm = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("w", r"\boxed{4}")]))
            assert warm.results[0].score == 1.0, warm
            hostile = stub.ScoreBatch.future(
                reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("hostile", HOSTILE)]), timeout=60
            )
            _wait_busy(server.pid, "the hostile sample is being scored")
            bystander = stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("bystander", "#### 4")]), timeout=20
            )
            # Answered while the hostile sample is still running: it did not wait for it.
            assert bystander.results[0].score == 1.0 and not bystander.results[0].HasField("error")
            assert not hostile.done()
            (result,) = hostile.result().results
            assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert "rule 'math' timed out after 5s" in result.error.message
            # The server goes on: the next math sample gets a fresh worker.
            again = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("a", r"\boxed{4}")]))
            assert again.results[0].score == 1.0

            # SIGTERM while a hostile sample runs: it is answered (over budget), the server exits within grace.
            workers = _children(server.pid)
            assert workers
            pending = stub.ScoreBatch.future(
                reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("hostile-2", HOSTILE)]), timeout=60
            )
            _wait_busy(server.pid, "the second hostile sample is being scored")
            server.signal(signal.SIGTERM)
            (late,) = pending.result().results
            assert late.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert server.proc is not None and server.proc.wait(timeout=grace_s) == 0
        # the orphans' exit is asynchronous to ours
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not [pid for pid in workers if _alive(pid)], "the workers exit", timeout_s=30)
        left = {pid: _cmdline(pid) for pid in workers if _alive(pid)}
        assert not left, f"processes outlived the server: {left}"
    finally:
        server.kill()


def _math(response: str, sid: str = "s") -> RewardInput:
    return RewardInput(
        sid, np.zeros(1, np.int32), np.zeros(1, np.int32), response_text=response, ground_truth="4", data_source="m"
    )


async def test_rule_source_isolates_math_and_keeps_cheap_rules_inline() -> None:
    assert RuleSource(name="g", rule="gsm8k").mode == "inline"
    source = RuleSource(name="m", rule="math", timeout_s=2.0, workers=1)
    assert source.mode == "process"
    try:
        results = await source.score_batch([_math(r"\boxed{4}"), _math(HOSTILE), _math(r"\boxed{5}")])
    finally:
        await source.close()
    assert isinstance(results[0], RewardOutput) and results[0].score == 1.0
    assert isinstance(results[1], DeadlineExceeded) and "timed out after 2s" in str(results[1])
    assert isinstance(results[2], RewardOutput) and results[2].score == 0.0  # behind the hung one, not failed


async def test_pool_runs_many_calls_per_round_trip_and_reports_failures_per_call() -> None:
    pool = IsolatedPool("t", workers=2, timeout_s=5.0)
    try:
        calls = [Call("builtins:divmod", {}, f"divmod {i}", args=(i, 3 - i % 4)) for i in range(40)]
        await pool.warmup()
        assert len(pool.pids) == 2 and os.getpid() not in pool.pids
        results = await pool.run(calls)
        assert pool.spawned == 2  # none was replaced: a call that raises fails alone
    finally:
        await pool.close()
    for i, result in enumerate(results):
        if 3 - i % 4 == 0:
            assert isinstance(result, SourceFailed) and "ZeroDivisionError" in str(result)
        else:
            assert result == divmod(i, 3 - i % 4)


async def test_closed_pool_kills_a_stuck_worker_at_once() -> None:
    pool = IsolatedPool("t", workers=1, timeout_s=60.0)
    call = asyncio.ensure_future(pool.run([Call("time:sleep", {}, "sleep", args=(60,))]))
    await pool.warmup()
    await eventually(lambda: not pool._queue, "the call taken by the worker's lane")
    (pid,) = pool.pids
    await pool.close()
    (result,) = await asyncio.wait_for(call, 10)
    assert "closed" in str(result)
    assert not _alive(pid)


async def test_a_normal_call_does_not_queue_behind_budgets_being_burned() -> None:
    """Four calls that hold their workers for their whole budget, two workers, and a normal call queued behind
    them all: it is answered while every slow call still runs (their lanes were replaced, not waited for)."""
    pool = IsolatedPool("t", workers=2, timeout_s=60.0, straggler_after_s=0.3)
    try:
        await pool.warmup()
        loop = asyncio.get_running_loop()
        hostile = [asyncio.ensure_future(pool.run([Call("time:sleep", {}, f"hog {i}", args=(60,))])) for i in range(4)]
        started = loop.time()
        (normal,) = await asyncio.wait_for(pool.run([Call("builtins:divmod", {}, "normal", args=(7, 2))]), 30)
        waited = loop.time() - started
        assert normal == (3, 1)
        assert not any(h.done() for h in hostile)  # answered long before any budget ran out
        assert waited < 30  # the hostile budget is 60 s: bounded by lane replacement, not by budgets
        assert pool.stragglers <= pool.max_stragglers
        # Once the slow calls end, the pool is back to its workers, and keeps serving.
        assert await pool.run([Call("builtins:divmod", {}, "again", args=(9, 4))]) == [(2, 1)]
    finally:
        await pool.close()
    for h in hostile:
        (result,) = await asyncio.wait_for(h, 10)
        assert "closed" in str(result)


@pytest.mark.slow
async def test_slow_calls_beyond_the_straggler_cap_queue_and_every_one_is_answered_once() -> None:
    pool = IsolatedPool("t", workers=1, timeout_s=1.5, straggler_after_s=0.1, max_stragglers=1)
    try:
        calls = [Call("time:sleep", {}, f"slow {i}", args=(0.4,)) for i in range(4)]
        calls += [Call("builtins:divmod", {}, f"fast {i}", args=(i, 1)) for i in range(6)]
        results = await asyncio.wait_for(pool.run(calls), 60)
        assert pool.stragglers <= 1
    finally:
        await pool.close()
    assert results[:4] == [None] * 4
    assert results[4:] == [(i, 0) for i in range(6)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_normal_math_sample_is_answered_while_four_hostile_ones_burn_their_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve reward` as a real process, the `math` pipeline on its two default workers: four hostile answers,
    then a normal one. The normal one is scored while all four still run (each has 20 s)."""
    monkeypatch.setenv("REWARDMESH_RULE_TIMEOUT_S", "20")
    server = ServerProcess("reward", [*CLI, "serve", "reward", "--port", "0", "--host", "127.0.0.1"], tmp_path)
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            warm = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("w", r"\boxed{4}")]))
            assert warm.results[0].score == 1.0, warm
            hostile = [
                stub.ScoreBatch.future(
                    reward_pb2.ScoreBatchRequest(reward="math", samples=[sample(f"h{i}", HOSTILE)]), timeout=90
                )
                for i in range(4)
            ]
            _wait_busy(server.pid, "the hostile samples are being scored")
            normal = stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("normal", r"\boxed{4}")]), timeout=60
            )
            assert normal.results[0].score == 1.0 and not normal.results[0].HasField("error")
            assert not any(h.done() for h in hostile)  # scored while every budget was still burning
            for h in hostile:
                (result,) = h.result().results
                assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            after = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="math", samples=[sample("a", r"\boxed{5}")]))
            assert after.results[0].score == 0.0 and not after.results[0].HasField("error")
    finally:
        server.kill()
