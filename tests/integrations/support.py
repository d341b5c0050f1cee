"""A real reward server (and its HTTP gateway) on 127.0.0.1 in a thread of its own, for framework code that
runs its own event loops (verl's reward-loop worker, TRL's reward thread) or none at all."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from rewardmesh.server.reward.http_gateway import gateway_token
from rewardmesh.server.reward.server import RewardServer, build_engine
from rewardmesh.server.serving import ServerOptions
from tests.support.servers import http_gateway, reward_server


@dataclass
class RunningServer:
    address: str  # gRPC HOST:PORT
    url: str  # HTTP gateway base URL


@contextlib.asynccontextmanager
async def guarded_server(pipelines: dict[str, Any] | None, token_file: str) -> AsyncIterator[RewardServer]:
    """A reward server requiring the token in `token_file` on gRPC (and so on its gateway)."""
    options = ServerOptions(host="127.0.0.1", port=0, grace_s=1.0, auth_token_file=token_file)
    server = RewardServer(build_engine(pipelines), options)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


@contextlib.contextmanager
def server_thread(
    pipelines: dict[str, Any] | None = None, *, grpc_token_file: str = "", **gateway: Any
) -> Iterator[RunningServer]:
    """Start the reward server and gateway on a loop in a daemon thread; stop both on exit. With
    `grpc_token_file`, both require that token, as `rewardmesh serve reward --auth-token-file` does."""
    gateway = {"default_pipeline": "gsm8k", **gateway}
    if grpc_token_file:
        gateway.setdefault("token", gateway_token("", grpc_token_file))
    ready: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            servers = guarded_server(pipelines, grpc_token_file) if grpc_token_file else reward_server(pipelines)
            async with servers as server, http_gateway(server, **gateway) as gw:
                ready["server"] = RunningServer(server.address, gw.url)
                started.set()
                await stop.wait()
        except BaseException as exc:
            ready["error"] = exc
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(120) or "error" in ready:
        raise RuntimeError(f"reward server did not start: {ready.get('error')}")
    try:
        yield ready["server"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
