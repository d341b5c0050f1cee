"""The one target pool: dns:/// expansion, re-resolution as pods come and go, backoff, membership hooks.

DNS answers cannot be changed for real here, so a resolve function stands in for the name server;
the servers and the gRPC traffic are real.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from typing import Any

import grpc
import pytest

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.client.targets import Member, TargetPool, expand_targets
from rewardmesh.common.channels import open_channel
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.servers import fn_pipeline, reward_server, sample
from tests.support.waiting import eventually


async def test_expand_resolves_dns_names_and_passes_plain_targets() -> None:
    assert await expand_targets("a:1, b:2") == ["a:1", "b:2"]
    assert (await expand_targets(["dns:///localhost:50051"]))[0].endswith(":50051")
    with pytest.raises(ValueError, match="expected dns:///HOST:PORT"):
        await expand_targets(["dns:///no-port"])
    with pytest.raises(ValueError, match="cannot resolve"):
        await expand_targets(["dns:///name.invalid:1"])
    with pytest.raises(ValueError, match="expected dns:///HOST:PORT"):
        TargetPool("dns:///no-port", Member)  # malformed names fail at construction, not in the background


async def test_resolution_never_blocks_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow name server holds a thread, not the loop: other coroutines keep running meanwhile."""
    release = threading.Event()
    real = socket.getaddrinfo

    def slow_getaddrinfo(*args: Any, **kwargs: Any) -> Any:
        release.wait(60)  # set by the test once it has seen the loop run on
        return real("localhost", *args[1:], **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    resolving = asyncio.create_task(expand_targets("dns:///slow.example:7"))
    ticks = 0
    for _ in range(5):
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and not resolving.done()
    release.set()
    assert (await resolving)[0].endswith(":7")


async def test_pool_reports_changes_keeps_addresses_when_resolution_fails() -> None:
    answers: list[list[str] | Exception] = [["a:1"], ["a:1"], ValueError("NXDOMAIN"), ["a:1", "b:1"]]
    changes: list[tuple[list[str], list[str]]] = []

    def resolve(specs: list[str]) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pool = TargetPool("dns:///svc:1", Member, resolve=resolve, interval_s=3600)
    pool.on_change(lambda added, removed: changes.append(([m.address for m in added], [m.address for m in removed])))
    assert pool.members == [] and pool.pick() is None  # the first pick starts resolving in the background
    await pool.refresh_now()
    assert [m.address for m in pool.members] == ["a:1"]
    await pool.refresh_now()  # unchanged
    await pool.refresh_now()  # resolution failed: keep what we know
    assert [m.address for m in pool.members] == ["a:1"]
    await pool.refresh_now()
    assert [m.address for m in pool.members] == ["a:1", "b:1"]
    assert changes == [(["a:1"], []), (["b:1"], [])]
    await pool.close()


async def test_pick_least_loaded_backs_off_with_jitter_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    class Loaded(Member):
        def __init__(self, address: str, server_name: str = "") -> None:
            super().__init__(address, server_name)
            self.work = 0

        @property
        def load(self) -> int:
            return self.work

    pool = TargetPool(["a:1", "b:1"], Loaded, backoff_s=0.5, max_backoff_s=2.0)
    a, b = pool.members
    a.work = 3
    assert pool.pick() is b and pool.pick(avoid=b) is a
    caplog.set_level(logging.DEBUG, logger="rewardmesh.client.targets")
    downs = []
    for _ in range(6):
        pool.mark_failed(b, "connection refused")
        downs.append(b.down_until)
    assert pool.pick() is a  # b backs off
    waits = [d - min(downs) for d in downs]
    assert max(waits) <= 2.0 + 0.01  # capped
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "rewardmesh.client.targets"]
    assert len(warnings) == 1  # once per state change (other loggers' leftovers do not count)
    assert "b:1 is down" in caplog.text
    pool.mark_ok(b)
    assert pool.pick() is b and not b.down and "b:1 is back" in caplog.text
    # Jitter: two members failing together do not come back at the same instant.
    c = TargetPool([f"c:{i}" for i in range(8)], Member, backoff_s=1.0)
    for m in c.members:
        c.mark_failed(m, "x")
    assert len({m.down_until for m in c.members}) == 8


async def test_join_hook_runs_before_a_new_or_recovered_member_gets_work() -> None:
    pods = ["a:1"]
    joined: list[str] = []
    gate = asyncio.Event()

    async def hook(member: Member) -> None:
        await gate.wait()
        joined.append(member.address)

    pool = TargetPool("dns:///svc:1", Member, resolve=lambda specs: list(pods), interval_s=3600, backoff_s=0.01)
    pool.on_join(hook)
    await pool.refresh_now()
    assert pool.pick() is None  # a is joining: no work until its hook is done
    gate.set()
    await eventually(lambda: joined == ["a:1"], "a's join hook ran")
    (a,) = pool.members
    assert pool.pick() is a
    pool.mark_failed(a, "restarted")
    await eventually(lambda: time.monotonic() >= a.down_until, "a's backoff ends")
    assert pool.pick() is None and a.joining  # back from a failure: rejoins first
    await eventually(lambda: joined == ["a:1", "a:1"], "a's join hook ran again")
    assert pool.pick() is a
    await pool.close()


async def test_reward_client_follows_pods_that_are_replaced_and_added() -> None:
    pipes = {"sleepy": fn_pipeline("sleepy")}
    async with reward_server(pipes) as a, reward_server(pipes) as b:
        pods = [a.address]
        target = "dns:///reward:50051"
        async with RewardClient(target, resolve=lambda specs: list(pods), resolve_interval_s=0.0,
                                retry_backoff_s=0.05) as client:  # fmt: skip
            first = [client.submit(sample(f"a{i}", delay=0.4), "sleepy") for i in range(6)]
            await eventually(lambda: a.servicer.in_flight == 6, "the six samples in flight on pod a")
            pods[:] = [b.address]  # a rolling update replaced pod a with pod b
            await a.grpc.server.stop(0)
            results = await asyncio.gather(*first)
            assert [s.address for s in client.streams] == [b.address]
            pods[:] = [b.address, a.address]  # scale-out: a new pod appears (a's address reused, it is down)
            more = await asyncio.gather(*(client.submit(sample(f"b{i}"), "sleepy") for i in range(4)))
            assert sorted(s.address for s in client.streams) == sorted([a.address, b.address])
    assert all(not r.HasField("error") for r in [*results, *more])
    assert sorted(r.sample_id for r in results) == [f"a{i}" for i in range(6)]


def test_closing_a_client_with_an_open_stream_leaves_nothing_behind() -> None:
    """No 'Task was destroyed but it is pending', no 'aclose(): asynchronous generator is already running'."""
    problems: list[str] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: problems.append(str(ctx)))
        async with reward_server({"sleepy": fn_pipeline("sleepy")}) as server:
            client = RewardClient([server.address])
            done = await client.submit(sample("quick"), "sleepy")
            slow = client.submit(sample("slow", delay=5.0), "sleepy")
            await eventually(lambda: server.servicer.in_flight == 1, "the slow sample in flight")
            await client.close()  # the stream is open and a sample is in flight
            assert not done.HasField("error") and slow.cancelled()
        gc.collect()

    asyncio.run(scenario())
    gc.collect()
    assert [p for p in problems if not _another_loops_event(p)] == []


def _another_loops_event(problem: str) -> bool:
    """grpc's poller hands an event of a call made on an earlier test's loop, closed since, back to that loop: the
    forward fails with 'Event loop is closed' and is reported on the loop that runs now. It is not this loop's, which
    is running."""
    return "PollerCompletionQueue._handle_events" in problem and "Event loop is closed" in problem


async def test_dead_target_is_retried_with_backoff_not_in_a_tight_loop(caplog: pytest.LogCaptureFixture) -> None:
    async with reward_server() as server:
        address = server.address
    caplog.set_level(logging.INFO)
    async with RewardClient([address], max_attempts=4, retry_backoff_s=0.05) as client:
        results = await asyncio.gather(*(client.submit(sample(f"s{i}"), "gsm8k") for i in range(20)))
        (stream,) = client.streams
        assert stream.failures >= 2  # the backoff grew while it stayed down
    assert all(r.HasField("error") for r in results)
    down_lines = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(down_lines) == 1, [r.getMessage() for r in caplog.records]


async def test_a_caller_never_waits_on_a_backoff_that_earlier_failures_grew() -> None:
    """A member down for long backs off for max_backoff_s, but a caller's own tries follow its own schedule: at
    once, then backoff_s, 2 x backoff_s ... (jittered down to half), probing the member whose backoff ends first."""
    pool = TargetPool(["a:1", "b:1"], Member, backoff_s=0.1, max_backoff_s=30.0)
    for _ in range(20):
        for m in pool.members:
            pool.mark_failed(m, "connection refused")
    assert pool.pick() is None and pool.retry_in() >= 0.5 * 30.0 - 0.1  # the pool's own view: long backoffs
    assert pool.retry_in(0) == 0.0  # a new caller tries at once
    for attempt in range(1, 6):
        assert 0.05 * 2 ** (attempt - 1) <= pool.retry_in(attempt) <= 0.1 * 2 ** (attempt - 1)
    a, b = pool.members
    a.down_until = b.down_until - 1.0  # a's backoff ends first
    assert pool.pick(probe=True) is a and pool.pick(avoid=a, probe=True) is b
    woke: list[Member] = []
    pool.on_up(woke.append)
    pool.mark_ok(b)
    assert woke == [b] and pool.pick() is b
    await pool.close()


async def test_repeated_calls_on_a_down_fleet_fail_as_fast_as_the_first() -> None:
    async with reward_server() as server:
        address = server.address
    async with RewardClient([address], max_attempts=5, retry_backoff_s=0.05) as client:
        for call in range(6):
            started = time.monotonic()
            results = await asyncio.gather(*(client.submit(sample(f"c{call}-{i}"), "gsm8k") for i in range(8)))
            # Each sample made its own 5 attempts: about 0.05 x (1 + 2 + 4 + 8) s of waiting. Waiting on the
            # member's backoff instead (5 s once it had failed a dozen times) would take over 10 s a call.
            assert time.monotonic() - started < 8.0, call
            assert all("after 5 attempts" in r.error.message for r in results), results[0]
        (stream,) = client.streams
        assert stream.failures >= 10 and stream.down_until - time.monotonic() > 0  # down for long, backing off


class Dialed(Member):
    """A member with a real channel (what the pool watches while the member is down)."""

    def __init__(self, address: str, server_name: str = "") -> None:
        super().__init__(address, server_name)
        self.channel = open_channel(address)

    async def close(self) -> None:
        assert self.channel is not None
        await self.channel.close(grace=None)


async def test_a_down_member_is_usable_at_once_when_its_server_is_back(caplog: pytest.LogCaptureFixture) -> None:
    """Its backoff has half a minute to run; its channel connecting again ends it, and wakes who waits."""
    caplog.set_level(logging.INFO, logger="rewardmesh.client.targets")
    async with reward_server() as server:
        address = server.address
    pool = TargetPool([address], Dialed, backoff_s=30.0, max_backoff_s=60.0)
    (member,) = pool.members
    woke: list[Member] = []
    pool.on_up(woke.append)
    try:
        assert member.channel is not None
        with pytest.raises(grpc.RpcError):  # a real failed call: the channel has lost its connection
            await reward_pb2_grpc.RewardServiceStub(member.channel).ListRewards(reward_pb2.ListRewardsRequest())
        pool.mark_failed(member, "connection refused")
        assert member.down_until - time.monotonic() > 14.0 and pool.pick() is None
        back = RewardServer(build_engine(None), ServerOptions(host="127.0.0.1", port=int(address.rsplit(":", 1)[1])))
        await back.start()
        try:
            await pool.wait_up(60.0)
            assert pool.pick() is member and woke == [member]  # before its backoff ended
            assert member.down_until == 0.0 and "is reachable again" in caplog.text
        finally:
            await back.stop(grace=0.5)
    finally:
        await pool.close()


async def test_a_sample_waiting_for_a_down_fleet_is_scored_once_a_target_is_back() -> None:
    async with reward_server() as server:
        address = server.address
    port = int(address.rsplit(":", 1)[1])
    async with RewardClient([address], max_attempts=100, retry_backoff_s=1.0) as client:
        waiting = client.submit(sample("w"), "gsm8k")
        (stream,) = client.streams
        await eventually(lambda: stream.down and stream.failures >= 2, "the sample's tries failed")
        assert not waiting.done()
        back = RewardServer(build_engine(None), ServerOptions(host="127.0.0.1", port=port))
        await back.start()
        try:
            result = await asyncio.wait_for(waiting, 60)
        finally:
            await back.stop(grace=0.5)
    assert not result.HasField("error") and result.score == 1.0
