"""FunctionSource: loading user functions, each executor, failures isolated per sample, timeouts."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from rewardmesh.common.errors import DeadlineExceeded, ResourceExhausted, SourceFailed, Unavailable
from rewardmesh.reward_engine.sources.custom import FunctionSource
from rewardmesh.reward_engine.types import RewardOutput
from tests.support import reward_fns
from tests.support.paths import REPO
from tests.support.samples import reward_input as sample
from tests.support.waiting import eventually

FILE = "tests/support/reward_fns.py"
MODULE = "tests.support.reward_fns"


@asynccontextmanager
async def function_source(**config: Any) -> AsyncIterator[FunctionSource]:
    source = FunctionSource(name=config.pop("name", "fn"), **config)
    try:
        yield source
    finally:
        await source.close()


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """File specs are relative to the working directory."""
    monkeypatch.chdir(REPO)


# ------------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests/support/reward_fns.py", "module:function"),  # no colon
        ("tests/no_such_file.py:exact", "does not exist"),
        ("tests/support/reward_fns.py:no_such_fn", "no attribute 'no_such_fn'"),
        ("tests.support.reward_fns:no_such_fn", "no attribute 'no_such_fn'"),
        ("tests.no_such_module:exact", "no module named 'tests.no_such_module'"),
        ("tests/support/reward_fns.py:NOT_CALLABLE", "not a callable"),
        (":exact", "both parts"),
        ("tests.support.reward_fns:", "both parts"),
    ],
)
def test_bad_spec_is_a_clear_value_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FunctionSource(name="fn", function=spec)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"executor": "gpu"}, "'executor'"),
        ({"timeout_s": 0}, "'timeout_s'"),
        ({"max_workers": 0}, "'max_workers'"),
    ],
)
def test_bad_config_names_the_key(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        FunctionSource(name="fn", function=f"{MODULE}:exact", **config)


def test_auto_executor_choice() -> None:
    assert FunctionSource(name="a", function=f"{MODULE}:exact").mode == "process"
    assert FunctionSource(name="b", function=f"{MODULE}:exact_async").mode == "loop"
    assert FunctionSource(name="c", function=f"{FILE}:exact", executor="inline").mode == "loop"
    source = FunctionSource(name="d", function=f"{FILE}:exact", executor="thread")
    assert (source.kind, source.target, source.mode) == ("function", f"{FILE}:exact", "thread")


# ----------------------------------------------------------------------------------- each executor


@pytest.mark.parametrize("spec", [f"{FILE}:detailed", f"{MODULE}:detailed"])
@pytest.mark.parametrize("executor", ["inline", "thread"])
async def test_in_process_executors_file_and_module(spec: str, executor: str) -> None:
    async with function_source(function=spec, executor=executor) as source:
        results = await source.score_batch([sample("42", "42"), sample("41", "42")])
    assert results == [
        RewardOutput(0.5, {"length": 2.0, "matched": 1.0, "pid": float(os.getpid()), "forked": 1.0, "source_len": 4.0}),
        RewardOutput(
            -0.5, {"length": 2.0, "matched": 0.0, "pid": float(os.getpid()), "forked": 1.0, "source_len": 4.0}
        ),
    ]


@pytest.mark.parametrize("spec", [f"{FILE}:detailed", f"{MODULE}:detailed"])
async def test_process_executor_runs_in_spawned_workers(spec: str) -> None:
    async with function_source(function=spec, max_workers=2) as source:
        assert source.mode == "process"
        results = await source.score_batch([sample("42", "42"), sample("41", "42"), sample("", "42")])
    assert [r.score for r in results if isinstance(r, RewardOutput)] == [0.5, -0.5, -0.5]
    for result in results:
        assert isinstance(result, RewardOutput)
        assert result.extras["pid"] != os.getpid()
        assert result.extras["forked"] == 0.0  # a fresh interpreter: spawned, not forked
        assert "note" not in result.extras


@pytest.mark.parametrize("executor", ["auto", "inline", "thread", "process"])
async def test_async_function_in_every_executor(executor: str) -> None:
    async with function_source(function=f"{FILE}:exact_async", executor=executor) as source:
        results = await source.score_batch([sample("7", "7"), sample("8", "7")])
    assert results == [RewardOutput(1.0, {}), RewardOutput(0.0, {})]


async def test_cpu_heavy_work_runs_in_other_processes() -> None:
    async with function_source(function=f"{FILE}:cpu_heavy", max_workers=2) as source:
        await source.warmup()
        assert source.pool is not None
        workers = set(source.pool.pids)
        assert len(workers) == 2 and os.getpid() not in workers
        results = await source.score_batch([sample(str(i), n=200_000) for i in range(4)])
        # On a loaded host a call can run past its straggler time and step aside: the pool then starts a worker
        # process beside it, where the next call runs; either way, a worker of the pool, never this process.
        workers |= source.pool.pids
    pids = {r.extras["pid"] for r in results if isinstance(r, RewardOutput)}
    assert len(results) == 4 and all(isinstance(r, RewardOutput) for r in results)
    assert pids <= {float(pid) for pid in workers} and float(os.getpid()) not in pids


# --------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
async def test_raising_sample_fails_alone(executor: str) -> None:
    async with function_source(function=f"{FILE}:boom", executor=executor, max_workers=2) as source:
        results = await source.score_batch([sample("fine"), sample("boom!"), sample("also fine")])
    assert results[0] == RewardOutput(1.0, {}) and results[2] == RewardOutput(1.0, {})
    assert isinstance(results[1], SourceFailed)
    assert str(results[1]) == f"function '{FILE}:boom' raised ValueError: cannot score 'boom!'"


@pytest.mark.parametrize("executor", ["inline", "process"])
async def test_bad_return_type_is_source_failed(executor: str) -> None:
    async with function_source(function=f"{MODULE}:returns_text", executor=executor) as source:
        (result,) = await source.score_batch([sample("x")])
    assert isinstance(result, SourceFailed)
    assert "returned str" in str(result) and "returns_text" in str(result)


@pytest.mark.slow
async def test_process_timeout_replaces_only_the_stuck_worker() -> None:
    async with function_source(function=f"{FILE}:sleepy", timeout_s=1.0, max_workers=2) as source:
        await source.warmup()
        assert source.pool is not None
        first_workers = set(source.pool.pids)
        started = time.monotonic()
        results = await source.score_batch([sample("fine", sleep_s=0.2), sample("hung", sleep_s=60)])
        assert time.monotonic() - started < 10
        assert isinstance(results[0], RewardOutput) and results[0].score == 1.0
        assert isinstance(results[1], DeadlineExceeded)
        assert str(results[1]) == f"function '{FILE}:sleepy' timed out after 1s"
        hung_pid = (first_workers - {int(results[0].extras["pid"])}).pop()

        # The stuck worker is killed; the source keeps working, never on it. (Its lane starts a new worker when it
        # next takes a call: which lane takes the next ones is the machine's timing, so how many run is not fixed.)
        await eventually(lambda: hung_pid not in {p.pid for p in multiprocessing.active_children()}, "hung worker gone")
        again = await source.score_batch([sample("a"), sample("b", sleep_s=0.1)])
        assert all(isinstance(r, RewardOutput) and r.score == 1.0 for r in again)
        assert hung_pid not in {r.extras["pid"] for r in again if isinstance(r, RewardOutput)}
        # A lane whose call ran past straggler_after_s (0.1 s here) stepped aside for a fresh lane, which starts
        # its worker on its own thread: wait for it rather than read the pool mid-start.
        pool = source.pool
        await eventually(lambda: 1 <= len(pool.pids) <= 2, "a worker on a serving lane")
        assert 1 <= len(pool.pids) <= 2 and hung_pid not in pool.pids


async def test_calls_behind_a_hung_one_run_on_a_fresh_worker() -> None:
    """Several calls share a round trip; the ones queued behind a hung call are not failed with it."""
    async with function_source(function=f"{FILE}:sleepy", timeout_s=1.0, max_workers=1) as source:
        await source.warmup()
        results = await source.score_batch([sample("a"), sample("hung", sleep_s=60), sample("b"), sample("c")])
        assert isinstance(results[1], DeadlineExceeded)
        assert [r.score for r in results if isinstance(r, RewardOutput)] == [1.0, 1.0, 1.0]


async def test_memory_budget_is_resource_exhausted_and_the_worker_is_replaced() -> None:
    async with function_source(function=f"{FILE}:hog", memory_mb=200, max_workers=1) as source:
        results = await source.score_batch([sample("small", mb=10), sample("huge", mb=4000), sample("small", mb=10)])
        assert results[0] == RewardOutput(1.0, {}) and results[2] == RewardOutput(1.0, {})
        assert isinstance(results[1], ResourceExhausted) and "ran out of memory" in str(results[1])


async def test_thread_timeout_then_next_calls_succeed() -> None:
    reward_fns.RELEASE.clear()
    try:
        async with function_source(function=f"{MODULE}:held", executor="thread", timeout_s=0.2, max_workers=1) as src:
            results = await src.score_batch([sample("hung", hold=True), sample("fine")])
            assert isinstance(results[0], DeadlineExceeded) and results[1] == RewardOutput(1.0, {})
            # The timed-out call still holds its thread (until the test releases it): with max_workers=1 this call
            # would wait behind it for good had its pool been reused.
            (result,) = await asyncio.wait_for(src.score_batch([sample("fine")]), 30)
            assert result == RewardOutput(1.0, {}) and not reward_fns.RELEASE.is_set()
    finally:
        reward_fns.RELEASE.set()


async def test_async_timeout_cancels_only_that_sample() -> None:
    async with function_source(function=f"{MODULE}:sleepy_async", timeout_s=0.2) as source:
        results = await source.score_batch([sample("slow", sleep_s=30), sample("fast"), sample("fast")])
        assert isinstance(results[0], DeadlineExceeded) and "timed out after 0.2s" in str(results[0])
        assert results[1:] == [RewardOutput(1.0, {}), RewardOutput(1.0, {})]
        assert await source.score_batch([sample("fast")]) == [RewardOutput(1.0, {})]


@pytest.mark.slow
async def test_dead_worker_fails_its_sample_only() -> None:
    """A worker that dies fails only the call it was running; the others go on on a fresh worker."""
    async with function_source(function=f"{FILE}:crash", max_workers=1) as source:
        results = await source.score_batch([sample("ok"), sample("crash"), sample("ok")])
        assert results[0] == RewardOutput(1.0, {}) and results[2] == RewardOutput(1.0, {})
        assert isinstance(results[1], SourceFailed) and "worker process died" in str(results[1])
        assert await source.score_batch([sample("ok")]) == [RewardOutput(1.0, {})]


async def test_closed_source_reports_unavailable() -> None:
    source = FunctionSource(name="fn", function=f"{FILE}:exact", executor="thread")
    assert await source.score_batch([sample("1", "1")]) == [RewardOutput(1.0, {})]
    await source.close()
    (result,) = await source.score_batch([sample("1", "1")])
    assert isinstance(result, Unavailable)


async def test_a_cancelled_hung_call_runs_on_to_its_budget_beside_the_next_call() -> None:
    """A cancelled caller's hung call keeps its worker until its budget kills it (a thread or process cannot
    be given back mid-call), but the next call does not wait for that: a fresh worker serves the queue."""
    async with function_source(function=f"{FILE}:sleepy", timeout_s=3.0, max_workers=1) as source:
        await source.warmup()
        assert source.pool is not None
        (hung_pid,) = source.pool.pids
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(source.score_batch([sample("hung", sleep_s=60)]), 0.5)
        (result,) = await asyncio.wait_for(source.score_batch([sample("next")]), 30)
        assert isinstance(result, RewardOutput) and result.score == 1.0
        assert int(result.extras["pid"]) != hung_pid  # a fresh worker, while the hung one still ran
        pool = source.pool
        await eventually(lambda: hung_pid not in pool.pids and not pool.stragglers, "the hung worker killed")
        assert len(pool.pids) == 1


@pytest.mark.parametrize("executor", ["process", "inline"])
async def test_a_function_returning_too_many_extras_fails_its_sample_only(executor: str) -> None:
    from rewardmesh.reward_engine.sources.verl_compat import MAX_EXTRAS

    async with function_source(function=f"{FILE}:many_extras", executor=executor, timeout_s=30.0) as source:
        huge, fine, edge = await source.score_batch(
            [sample("a", count=2_000_000), sample("b", count=3), sample("c", count=MAX_EXTRAS)]
        )
    assert isinstance(huge, SourceFailed) and "2000001 entries" in str(huge) and str(MAX_EXTRAS) in str(huge)
    assert isinstance(fine, RewardOutput) and fine.extras == {"x0": 0.0, "x1": 1.0, "x2": 2.0}
    assert isinstance(edge, RewardOutput) and len(edge.extras) == MAX_EXTRAS


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_processes_a_function_starts_die_with_its_worker(tmp_path: Any) -> None:
    """A function that shells out: the processes it started are killed with its worker, at its budget and when
    the source closes (the worker leads a process group of its own)."""
    async with function_source(function=f"{FILE}:forks_a_sleeper", timeout_s=2.0, max_workers=1) as source:
        first = tmp_path / "first.pid"
        (result,) = await asyncio.wait_for(source.score_batch([sample("x", pid_file=str(first))]), 30)
        assert isinstance(result, DeadlineExceeded)
        sleeper = int(first.read_text())
        await eventually(lambda: not _pid_alive(sleeper), "the sleeper killed with its timed-out worker", 10)
        second = tmp_path / "second.pid"
        call = asyncio.ensure_future(source.score_batch([sample("y", pid_file=str(second))]))
        await eventually(lambda: second.exists() and second.read_text(), "the second sleeper started", 30)
        other = int(second.read_text())
        assert _pid_alive(other)
    await eventually(lambda: not _pid_alive(other), "the sleeper killed when the source closed", 10)
    (closed,) = await asyncio.wait_for(call, 10)
    assert isinstance(closed, Unavailable | SourceFailed)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
async def test_processes_a_function_starts_do_not_outlive_the_server(tmp_path: Any, how: str) -> None:
    """`serve reward` as a real process, a function that shells out mid-sample; the server stopped (drained:
    SIGTERM) or killed outright (SIGKILL): the function's child process goes with it."""
    import signal as signals

    import grpc

    from rewardmesh.demo.server_process import ServerProcess
    from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
    from tests.support.paths import CLI
    from tests.support.servers import sample as wire_sample

    config = tmp_path / "reward.yaml"
    spec = REPO / FILE
    config.write_text(
        "server:\n  grace_s: 2\npipelines:\n  forks:\n    sources:\n"
        f"      - {{type: function, function: '{spec}:forks_a_sleeper', timeout_s: 60}}\n"
    )
    server = ServerProcess(
        "reward", [*CLI, "serve", "reward", "--config", str(config), "--host", "127.0.0.1"], tmp_path
    )
    pid_file = tmp_path / "sleeper.pid"
    try:
        port = server.start(timeout_s=120)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            call = stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(reward="forks", samples=[wire_sample("x", pid_file=str(pid_file))]),
                timeout=90,
            )
            await eventually(lambda: pid_file.exists() and pid_file.read_text(), "the function started its child", 60)
            sleeper = int(pid_file.read_text())
            assert _pid_alive(sleeper)
            if how == "SIGKILL":
                server.kill()
            else:
                server.signal(signals.SIGTERM)
            try:  # a killed server answers nothing; a drained one ends the call, or fails the sample, past grace
                reply = await call
                assert reply.results[0].HasField("error"), reply
            except grpc.aio.AioRpcError:
                pass
        await eventually(lambda: not _pid_alive(sleeper), f"the child gone after {how}", 30)
    finally:
        server.kill()
