"""Shared server plumbing: one shutdown path (drain, stop, release once), one address, the port file."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from rewardmesh.demo.mesh import LOCAL
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import GrpcServer, ServerOptions


async def test_stop_releases_once_even_when_called_concurrently(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    server = RewardServer(build_engine(None), ServerOptions(host=LOCAL, port=0, grace_s=1, port_file=str(port_file)))
    released = 0
    close = server.engine.close

    async def counting_close(drain: bool = True) -> None:
        nonlocal released
        released += 1
        await close(drain=drain)

    server.engine.close = counting_close  # type: ignore[method-assign]
    port = await server.start()
    assert port_file.read_text().strip() == str(port) and server.address == f"{LOCAL}:{port}"
    await asyncio.gather(server.stop(grace=0.2), server.stop(grace=0.2), server.wait())
    await server.stop()
    assert released == 1


async def test_wildcard_bind_is_dialled_on_loopback() -> None:
    grpc_server = GrpcServer(ServerOptions(host="0.0.0.0"), [])  # never started: nothing is bound
    grpc_server.port = 50051
    assert grpc_server.address == "127.0.0.1:50051"
    assert GrpcServer(ServerOptions(host="10.1.2.3", port=7), []).address == "10.1.2.3:0"


async def test_a_signal_starts_one_kept_drain_and_a_second_signal_does_not_start_another() -> None:
    server = RewardServer(build_engine(None), ServerOptions(host=LOCAL, port=0, grace_s=0.2))
    await server.start()
    server.grpc._on_signal(signal.SIGTERM)
    stopping = server.grpc._stopping
    assert isinstance(stopping, asyncio.Task)  # referenced, so it cannot be collected mid-drain
    server.grpc._on_signal(signal.SIGINT)
    assert server.grpc._stopping is stopping
    await asyncio.wait_for(server.wait(), 10)
    assert stopping.done() and stopping.exception() is None
