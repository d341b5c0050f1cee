"""Mutual TLS from PEM files, with certificates made by openssl for the test; the health port stays plaintext."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rewardmesh.client.reward_client import RewardClient
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import ServerOptions
from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.pki import make_pki
from tests.support.ports import free_port
from tests.support.servers import sample

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
    pytest.mark.integration,
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_mutual_tls_scores_and_refuses_clients_without_a_certificate(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    health_port = free_port()
    options = ServerOptions(
        host="127.0.0.1",
        port=0,
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_ca=str(pki / "ca.crt"),
        health_port=health_port,
    )
    server = RewardServer(build_engine(None), options)
    await server.start()
    try:
        monkeypatch.setenv("REWARDMESH_TLS_CA", str(pki / "ca.crt"))
        monkeypatch.setenv("REWARDMESH_TLS_CERT", str(pki / "client.crt"))
        monkeypatch.setenv("REWARDMESH_TLS_KEY", str(pki / "client.key"))
        monkeypatch.setenv("REWARDMESH_TLS_SERVER_NAME", "reward.rewardmesh.svc.cluster.local")
        async with RewardClient([server.address]) as client:
            (result,) = await client.score_batch([sample("tls", "#### 4")], "gsm8k")
        assert result.score == 1.0
        # No client certificate: the handshake is refused.
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())
        opts = [("grpc.ssl_target_name_override", "localhost")]
        async with aio.secure_channel(server.address, creds, options=opts) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await reward_pb2_grpc.RewardServiceStub(ch).ListRewards(reward_pb2.ListRewardsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plaintext to the TLS port: refused; plaintext to the health port: answered (for kubelet probes).
        async with aio.insecure_channel(server.address) as ch:
            with pytest.raises(aio.AioRpcError):
                await reward_pb2_grpc.RewardServiceStub(ch).ListRewards(reward_pb2.ListRewardsRequest(), timeout=5)
        async with aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            status = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="rewardmesh.v1.RewardService"), timeout=5
            )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=0.5)


def test_half_configured_tls_is_a_clear_error(pki: Path) -> None:
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        ServerOptions(tls_cert=str(pki / "server.crt")).credentials()
    with pytest.raises(ValueError, match="tls_ca is set"):
        ServerOptions(tls_ca=str(pki / "ca.crt")).credentials()
