"""A service registered with some methods' own deserializers: those methods read requests their way, every other
method stays as generated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import torch
from grpc import aio

from rewardmesh.common.planes.grpc_chunks import UpdateView, iter_update_requests
from rewardmesh.demo.mesh import LOCAL
from rewardmesh.server.registration import with_deserializers
from rewardmesh.server.rollout.server import add_rollout_service
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc


class Recording(rollout_pb2_grpc.RolloutServiceServicer):
    """UpdateWeights records the type of what it reads; the other methods are the generated UNIMPLEMENTED ones."""

    def __init__(self) -> None:
        self.kinds: list[type] = []

    async def UpdateWeights(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for msg in request_iterator:
            self.kinds.append(type(msg))
        return rollout_pb2.UpdateWeightsResponse(num_tensors=len(self.kinds))


async def test_update_weights_is_read_by_the_chunk_parser_and_other_methods_stay_generated() -> None:
    servicer = Recording()  # type: ignore[abstract]
    server = aio.server()
    add_rollout_service(servicer, server)
    port = server.add_insecure_port(f"{LOCAL}:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"{LOCAL}:{port}") as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            messages = [rollout_pb2.UpdateWeightsRequest.FromString(m)
                        for m in iter_update_requests({"w": torch.ones(4)}, 1, chunk_bytes=8)]  # fmt: skip
            reply = await stub.UpdateWeights(iter(messages))
            assert reply.num_tensors == 2 and servicer.kinds == [UpdateView, UpdateView]
            with pytest.raises(aio.AioRpcError) as info:  # generated, and not implemented by this servicer
                await stub.GetInfo(rollout_pb2.GetInfoRequest())
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_a_method_the_service_lacks_is_refused_when_registered() -> None:
    register = with_deserializers(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, Upload=bytes)
    with pytest.raises(ValueError, match="RolloutService has no method Upload"):
        register(Recording(), aio.server())  # type: ignore[abstract]
