"""Real servers in-process on 127.0.0.1 port 0 (from the one mesh builder, `demo/mesh.py`), stubs and samples."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from grpc import aio

from rewardmesh.common.tensors import ids_tensor
from rewardmesh.demo.mesh import reward_server, rollout_server
from rewardmesh.server.reward.http_gateway import HttpGateway
from rewardmesh.server.reward.server import RewardServer
from rewardmesh.v1 import common_pb2, reward_pb2_grpc

__all__ = [
    "EOF",
    "FNS",
    "fn_pipeline",
    "http_gateway",
    "reward_server",
    "reward_stub",
    "rollout_server",
    "rollout_stub",
    "sample",
]

# grpc.aio's end-of-stream marker (grpc-stubs does not declare it).
EOF: Any = aio.EOF  # type: ignore[attr-defined]

FNS = str(Path(__file__).with_name("server_reward_fns.py"))


def fn_pipeline(function: str, **batching: Any) -> dict[str, Any]:
    """A pipeline of one test function from server_reward_fns.py, run on the event loop or a thread."""
    return {
        "sources": [{"type": "function", "function": f"{FNS}:{function}", "executor": "auto", "timeout_s": 2.0}],
        "batching": batching,
    }


@asynccontextmanager
async def reward_stub(address: str) -> AsyncIterator[Any]:
    """Typed Any: tests drive Score in grpc.aio's write()/read() style, which the generated stubs do not type."""
    async with aio.insecure_channel(address) as channel:
        yield reward_pb2_grpc.RewardServiceStub(channel)


def sample(sid: str, response: str = "#### 4", truth: str = "4", **extra: Any) -> common_pb2.Sample:
    s = common_pb2.Sample(
        sample_id=sid,
        group_id="g",
        prompt_ids=ids_tensor([1, 2, 3]),
        response_ids=ids_tensor([4, 5]),
        prompt_text="What is 2 + 2?",
        response_text=response,
        data_source="openai/gsm8k",
        ground_truth=truth,
    )
    if extra:
        s.extra_info.update(extra)
    return s


@asynccontextmanager
async def rollout_stub(address: str) -> AsyncIterator[Any]:
    from rewardmesh.v1 import rollout_pb2_grpc

    async with aio.insecure_channel(address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


@asynccontextmanager
async def http_gateway(server: RewardServer, **options: Any) -> AsyncIterator[HttpGateway]:
    """The reward server's HTTP gateway (OpenRLHF, slime) on 127.0.0.1 port 0, over the server's engine."""
    gateway = HttpGateway(server.engine, host="127.0.0.1", port=0, **options)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop(grace=0.5)
