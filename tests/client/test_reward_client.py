"""RewardClient against real servers: completion order, failover without double delivery, drain, dead targets."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.common.channels import open_channel
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import ServerOptions
from tests.support.servers import fn_pipeline, reward_server, sample
from tests.support.waiting import eventually

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


async def test_score_yields_in_completion_order() -> None:
    async with reward_server({"sleepy": fn_pipeline("sleepy")}) as server:
        async with RewardClient([server.address]) as client:
            samples = [sample(f"s{i}", response="x" * i, delay=0.05 * (5 - i)) for i in range(5)]
            got = [r.sample_id async for r in client.score(samples, "sleepy")]
    assert got == ["s4", "s3", "s2", "s1", "s0"]


async def test_balances_over_targets_by_outstanding_work() -> None:
    async with (
        reward_server({"sleepy": fn_pipeline("sleepy")}) as a,
        reward_server({"sleepy": fn_pipeline("sleepy")}) as b,
    ):
        async with RewardClient([a.address, b.address]) as client:
            futures = [client.submit(sample(f"s{i}", delay=0.2), "sleepy") for i in range(10)]
            assert [len(s.pending) for s in client.streams] == [5, 5]
            results = await asyncio.gather(*futures)
    assert all(not r.HasField("error") for r in results)
    assert client.rerouted == 0
    assert a.servicer.results_sent == 5 and b.servicer.results_sent == 5


async def test_a_new_client_reaches_a_server_on_an_address_another_channel_failed_to_reach() -> None:
    """A server comes back on an address where an earlier server stopped, while a channel that failed to reach
    the old one is still open (in reconnect backoff): a new client is answered at once, not refused with that
    channel's failure (gRPC shares subchannels between channels unless each keeps its own)."""
    async with reward_server() as old:
        port = old.port
        stale = open_channel(old.address)
        health = health_pb2_grpc.HealthStub(stale)
        await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
    try:
        with pytest.raises(aio.AioRpcError):  # the stale channel finds nobody there, and backs off
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        new = RewardServer(build_engine(None), ServerOptions(host="127.0.0.1", port=port))
        await new.start()
        try:
            async with RewardClient([new.address]) as client:
                result = await asyncio.wait_for(client.submit(sample("s"), "gsm8k"), 30)
                assert client.rerouted == 0 and not client.streams[0].down
        finally:
            await new.stop(grace=0.5)
    finally:
        await stale.close(None)
    assert not result.HasField("error") and result.score == 1.0


async def test_target_killed_mid_stream_every_sample_answered_exactly_once() -> None:
    async with (
        reward_server({"sleepy": fn_pipeline("sleepy")}) as a,
        reward_server({"sleepy": fn_pipeline("sleepy")}) as b,
    ):
        async with RewardClient([a.address, b.address], retry_backoff_s=0.05) as client:
            futures = {f"s{i}": client.submit(sample(f"s{i}", delay=0.3), "sleepy") for i in range(40)}
            await eventually(lambda: a.servicer.in_flight > 0, "a holds samples")
            await a.grpc.server.stop(0)  # abrupt: no drain, streams cut
            results = await asyncio.gather(*futures.values())
            assert client.rerouted >= 1
    assert Counter(r.sample_id for r in results) == Counter(futures.keys())  # each exactly once
    assert all(not r.HasField("error") for r in results), [r.error for r in results if r.HasField("error")]
    assert b.servicer.results_sent >= 20


async def test_draining_target_hands_its_new_samples_to_another() -> None:
    async with (
        reward_server({"sleepy": fn_pipeline("sleepy")}) as a,
        reward_server({"sleepy": fn_pipeline("sleepy")}) as b,
    ):
        async with RewardClient([a.address, b.address], retry_backoff_s=0.05) as client:
            first = [client.submit(sample(f"a{i}", delay=0.3), "sleepy") for i in range(6)]
            await eventually(lambda: a.servicer.in_flight + b.servicer.in_flight == 6, "the first six in flight")
            drain = asyncio.create_task(a.stop(grace=5))
            await eventually(lambda: a.servicer.scoring.draining, "a is draining")
            later = [client.submit(sample(f"b{i}", delay=0.0), "sleepy") for i in range(6)]
            results = await asyncio.gather(*first, *later)
            await drain
    assert all(not r.HasField("error") for r in results)
    assert sorted(r.sample_id for r in results) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])


async def test_no_live_target_gives_unavailable_result_not_a_hang() -> None:
    async with reward_server() as server:
        address = server.address
    async with RewardClient([address], max_attempts=3, retry_backoff_s=0.02) as client:
        result = await asyncio.wait_for(client.submit(sample("orphan"), "gsm8k"), 20)
    assert result.error.code == UNAVAILABLE
    assert "after 3 attempts" in result.error.message and address in result.error.message


async def test_score_batch_and_list_rewards() -> None:
    async with reward_server() as server, RewardClient(server.address) as client:
        results = await client.score_batch([sample("a", "#### 4"), sample("b", "#### 3")], "gsm8k")
        listing = await client.list_rewards()
    assert [r.score for r in results] == [1.0, 0.0]
    assert "gsm8k" in [p.name for p in listing.pipelines]
