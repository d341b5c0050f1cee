"""Bearer-token auth: every service refuses a call without the token (UNAUTHENTICATED), health stays open,
and every client sends the token from the environment, the rollout server's reward client included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardmesh.common.channels import auth_token, open_channel
from rewardmesh.common.tensors import ids_tensor
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.rollout.server import RolloutServer
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.support.scripted_backend import ScriptedBackend
from tests.support.servers import sample

TOKEN = "s3cret-token"


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@asynccontextmanager
async def guarded_reward(token_file: str) -> AsyncIterator[RewardServer]:
    server = RewardServer(build_engine(None), ServerOptions(host="127.0.0.1", port=0, auth_token_file=token_file))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


async def test_calls_without_the_token_are_unauthenticated_and_health_stays_open(token_file: str) -> None:
    async with guarded_reward(token_file) as rs, aio.insecure_channel(rs.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
            with pytest.raises(aio.AioRpcError) as err:
                await stub.ListRewards(reward_pb2.ListRewardsRequest(), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(aio.AioRpcError) as err:
            async for _ in stub.Score(iter([reward_pb2.ScoreRequest(sample=sample("a"), reward="gsm8k")])):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rs.servicer.results_sent == 0  # nothing was scored for the refused stream
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        ok = await stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("b")]),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
        assert ok.results[0].score == 1.0


async def test_clients_send_the_token_from_the_environment(token_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", TOKEN)
    assert auth_token() == TOKEN
    async with guarded_reward(token_file) as rs, open_channel(rs.address, rpc_spans=False) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        got = [r async for r in stub.Score(iter([reward_pb2.ScoreRequest(sample=sample("a"), reward="gsm8k")]))]
    assert got[0].result.score == 1.0


def test_token_file_problems_are_clear(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        auth_token(str(empty))
    with pytest.raises(ValueError, match="cannot read"):
        auth_token(str(tmp_path / "missing"))


async def test_rollout_server_and_its_reward_client_use_the_token(
    tok: Any, token_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both servers guarded by one token: the trainer's Generate and the rollout server's Score stream pass."""
    monkeypatch.setenv("REWARDMESH_AUTH_TOKEN_FILE", token_file)
    backend = ScriptedBackend(tok, lambda text, turn: ("#### 4", 0.0))
    async with guarded_reward(token_file) as rs:
        ro = RolloutServer(backend, [rs.address], ServerOptions(host="127.0.0.1", port=0))  # token from the env
        await ro.start()
        try:
            request = rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=ids_tensor(tok.encode("hi")), ground_truth="4")],
                n=2,
                reward="gsm8k",
                sampling=rollout_pb2.SamplingParams(max_tokens=4),
            )
            async with aio.insecure_channel(ro.address) as bare:
                with pytest.raises(aio.AioRpcError) as err:
                    _ = [r async for r in rollout_pb2_grpc.RolloutServiceStub(bare).Generate(request)]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with open_channel(ro.address) as channel:
                got: list[Any] = [r async for r in rollout_pb2_grpc.RolloutServiceStub(channel).Generate(request)]
        finally:
            await ro.stop(grace=0.5)
    assert len(got) == 2 and all(r.result.score == 1.0 and not r.result.HasField("error") for r in got)


async def test_token_beside_mutual_tls_rides_as_call_credentials(
    tmp_path: Path, token_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rewardmesh.client.reward_client import RewardClient
    from tests.support.pki import make_pki

    pki = make_pki(tmp_path)
    options = ServerOptions(host="127.0.0.1", port=0, tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"),
                            tls_ca=str(pki / "ca.crt"), auth_token_file=token_file)  # fmt: skip
    server = RewardServer(build_engine(None), options)
    await server.start()
    try:
        for var, name in [("CA", "ca.crt"), ("CERT", "client.crt"), ("KEY", "client.key")]:
            monkeypatch.setenv(f"REWARDMESH_TLS_{var}", str(pki / name))
        monkeypatch.setenv("REWARDMESH_TLS_SERVER_NAME", "localhost")
        async with open_channel(server.address) as channel:  # a certificate but no token: refused
            with pytest.raises(aio.AioRpcError) as err:
                await reward_pb2_grpc.RewardServiceStub(channel).ListRewards(reward_pb2.ListRewardsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", TOKEN)
        async with RewardClient([server.address]) as client:
            (result,) = await client.score_batch([sample("tls", "#### 4")], "gsm8k")
        assert result.score == 1.0
    finally:
        await server.stop(grace=0.5)


async def test_a_wrong_token_is_unauthenticated_at_once_never_retried_as_a_down_target(
    token_file: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another try gets the same answer: the sample fails with UNAUTHENTICATED and what to do, after one
    attempt, and the target is not taken for down."""
    from rewardmesh.client.reward_client import RewardClient

    async with guarded_reward(token_file) as rs:
        for token in ("wrong", ""):
            monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", token)
            async with RewardClient(rs.address, max_attempts=5) as client:
                result = await client.submit(sample("a"), "gsm8k")
                assert result.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0], result
                assert "REWARDMESH_AUTH_TOKEN" in result.error.message
                assert client.rerouted == 0 and not client.streams[0].down
                with pytest.raises(aio.AioRpcError) as err:
                    await client.score_batch([sample("b")], "gsm8k")
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "is down" not in caplog.text


async def test_a_refusal_that_races_the_streams_writes_is_still_unauthenticated(
    token_file: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that refuses a Score stream ends it before reading it, and a message the client writes meanwhile
    fails: grpc.aio then reports that write's failure (INTERNAL) in place of the refusal. Samples submitted
    apart, so that later writes race the refusal: each is still UNAUTHENTICATED after one attempt, none is
    re-sent, and the target is never taken for down."""
    from rewardmesh.client.reward_client import RewardClient

    monkeypatch.setenv("REWARDMESH_AUTH_TOKEN", "wrong")
    async with guarded_reward(token_file) as rs:
        for i in range(60):
            async with RewardClient(rs.address, max_attempts=5) as client:
                futures = []
                for j in range(4):
                    futures.append(client.submit(sample(f"s{i}-{j}"), "gsm8k"))
                    await asyncio.sleep(0.0005 * (i % 5))  # writes spread over the refusal's way back
                results = await asyncio.gather(*futures)
                assert all(r.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0] for r in results), results
                assert client.rerouted == 0 and not client.streams[0].down
    assert "is down" not in caplog.text


async def test_a_refused_weight_stream_is_read_out_so_its_sender_hears_unauthenticated(
    tok: Any, token_file: str
) -> None:
    """UpdateWeights refused while its sender still writes chunks: the server reads the stream out before it
    answers, so the sender hears UNAUTHENTICATED every time, never a failed write's INTERNAL."""
    ro = RolloutServer(
        ScriptedBackend(tok, lambda text, turn: ("x", 0.0)), [],
        ServerOptions(host="127.0.0.1", port=0, auth_token_file=token_file),
    )  # fmt: skip
    await ro.start()
    try:
        async with aio.insecure_channel(ro.address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            for i in range(40):

                async def chunks(pause_s: float = 0.0005 * (i % 5)) -> AsyncIterator[rollout_pb2.UpdateWeightsRequest]:
                    for _ in range(6):
                        yield rollout_pb2.UpdateWeightsRequest()
                        await asyncio.sleep(pause_s)  # writes spread over the refusal's way back

                with pytest.raises(aio.AioRpcError) as err:
                    await stub.UpdateWeights(chunks(), metadata=(("authorization", "Bearer wrong"),))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    finally:
        await ro.stop(grace=0.5)
