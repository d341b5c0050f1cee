"""The one interface every data plane implements: its trainer side (`Sender`) sends an `Update` to servers and
returns each one's outcome; its server side stages what it received (`Staged`) for the validator, and the
rollout server commits it. gRPC stays the control plane: `TransferWeights` carries the manifest, the version and
where the bytes are (`transfer_request`), for every plane but grpc, whose chunks carry all of it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from grpc import aio

from rewardmesh.common.planes import delta
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from rewardmesh.common.planes.dist import SharedWeights

Target = tuple[str, aio.Channel]  # a server's address and the channel to it
Outcomes = dict[str, Any]  # address -> its TransferWeightsResponse, or the exception its call ended in


@dataclass
class Update:
    """One update as it travels: the manifest (with digests and encodings), each tensor's bytes on the wire (a
    delta's bytes in place of a tensor), and the changes a delta made (to bring the trainer's copy up to date)."""

    specs: list[rollout_pb2.WeightSpec]
    wire: dict[str, torch.Tensor]
    base: int = 0
    changes: dict[str, delta.Change] | None = None
    changed: float = -1.0

    @property
    def sent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.wire.values())


class Settings(Protocol):
    """What a sender reads from its trainer's settings at each update (they may change between updates)."""

    timeout_s: float
    bucket_bytes: int
    dist_host: str | None
    share_host: bool


class Sender(Protocol):
    """A plane's trainer side; keeps what outlives one update (a process group, a shared-memory file)."""

    async def send(
        self, targets: Sequence[Target], update: Update, version: int, infos: Sequence[rollout_pb2.GetInfoResponse]
    ) -> Outcomes:
        """Send `update` as `version` to every target; never raises for a server's failure (it is its outcome)."""
        ...

    def close(self) -> None: ...


@dataclass
class Staged:
    """What a plane's server side received, every byte of it, not yet checked or applied: the tensors, and what
    they lie in: `owned`, buffers of the server's that nothing else writes (a backend may adopt them); `file`, a
    host's shared file (dist); neither: memory the trainer owns (shm, cuda_ipc), only ever copied out of."""

    tensors: dict[str, torch.Tensor]
    owned: list[torch.Tensor] | None = None
    file: SharedWeights | None = None


async def gather(targets: Sequence[Target], call: Callable[[str, aio.Channel], Awaitable[Any]]) -> Outcomes:
    results = await asyncio.gather(*(call(a, ch) for a, ch in targets), return_exceptions=True)
    return {a: r for (a, _), r in zip(targets, results, strict=True)}


def transfer_request(update: Update, version: int, timeout_s: float) -> rollout_pb2.TransferWeightsRequest:
    req = rollout_pb2.TransferWeightsRequest(
        tensors=update.specs, policy_version=version, total_bytes=update.sent_bytes, delta_base_version=update.base
    )
    req.timeout.FromNanoseconds(int(timeout_s * 1e9))
    return req


async def call_transfer(channel: aio.Channel, request: rollout_pb2.TransferWeightsRequest, timeout_s: float) -> Any:
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    return await stub.TransferWeights(request, timeout=timeout_s + 10)
