"""`rewardmesh health`: the exec probe for clusters without gRPC probes (Kubernetes before 1.27), against a real
grpc.health.v1 server on a real socket."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rewardmesh.server.cli import main
from tests.support.ports import free_port

SERVICE = "rewardmesh.v1.RewardService"


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


def test_serving_exits_0_and_anything_else_exits_1_naming_the_status(
    health_server: tuple[int, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["health", "--port", str(port)]) == 0
    assert main(["health", "--port", str(port), "--service", SERVICE]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", "--port", str(port), "--service", SERVICE]) == 0
    assert main(["health", "--port", str(port), "--service", "no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_a_server_that_is_not_there_exits_1() -> None:
    port = free_port()
    assert main(["health", "--port", str(port), "--timeout-s", "2"]) == 1
