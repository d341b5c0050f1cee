"""The interfaces every data plane implements. Its trainer side (`Sender`) sends an `Update` to servers and
returns each one's outcome; its server side (`Receiver`) stages what it received (`Staged`) for the validator,
and the rollout server (the `Recipient` the planes stage for) commits it. gRPC stays the control plane:
`TransferWeights` carries the manifest, the version and where the bytes are (`transfer_request`; the request's
`source` names the plane, and a server keeps its receivers by that name, `by_source`), for every plane but grpc,
whose chunks carry all of it on `UpdateWeights` (its server side: `grpc_chunks.receive_chunks`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from grpc import aio

from rewardmesh.common.planes import delta
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from rewardmesh.common.planes.dist import SharedWeights
    from rewardmesh.common.planes.manifest import Entry

Target = tuple[str, aio.Channel]  # a server's address and the channel to it
TransferResult = rollout_pb2.TransferWeightsResponse | BaseException  # a server's answer, or what its call ended in
TransferResults = dict[str, TransferResult]  # by the server's address


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
    ) -> TransferResults:
        """Send `update` as `version` to every target; never raises for a server's failure (it is its outcome)."""
        ...

    def close(self) -> None: ...


@dataclass
class Staged:
    """What a plane's server side received, every byte of it, not yet checked or applied: the tensors, and what
    they lie in: `owned`, buffers of the server's that nothing else writes (a backend may adopt them); `file`, a
    host's shared file (dist); neither: memory the trainer owns (shm, cuda_ipc), only ever copied out of.
    `handles`: the trainer's CUDA IPC handles, for an engine that opens them itself (`tensors` is then empty)."""

    tensors: dict[str, torch.Tensor]
    owned: list[torch.Tensor] | None = None
    file: SharedWeights | None = None
    handles: rollout_pb2.CudaIpcSource | None = None


class Recipient(Protocol):
    """The rollout server a plane's server side stages an update for: what a plane may ask of it."""

    @property
    def host_id(self) -> str:
        """Who shares this server's /dev/shm ("" when it has none it can use)."""
        ...

    @property
    def weights_device(self) -> torch.device | None:
        """Where the model's weights live; None when the backend does not say."""
        ...

    @property
    def loads_cuda_ipc(self) -> bool:
        """The engine opens CUDA IPC handles itself (vLLM's weight transfer) rather than take opened tensors."""
        ...

    def cuda_uuid(self) -> str:
        """The GPU the model runs on ("" if none): where a trainer's CUDA IPC handles must point."""
        ...

    def staging(self, device: torch.device, delta: bool) -> Callable[[int], torch.Tensor]:
        """Where received bytes go: flat uint8 buffers of exactly the size asked for, nobody else's (`delta`: the
        update carries one, whose buffers are small: the spare the model left stays for the delta to start from)."""
        ...

    def host_file(self, size: int) -> SharedWeights | None:
        """The file this server receives a host's shared copy into (dist); None when there is no room for one."""
        ...


class Receiver(Protocol):
    """A plane's server side for `TransferWeights`: kept by the request's `source` case it reads, it says whether
    a server offers the plane, refuses what it can before a byte moves (`check`, also on `validate_only`), then
    stages every byte of the update (`receive`)."""

    source: str  # the TransferWeightsRequest.source case it reads
    transport: rollout_pb2.WeightTransport  # as GetInfo lists it when the server offers the plane

    def offered(self, recipient: Recipient) -> bool: ...

    def check(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], recipient: Recipient
    ) -> None: ...

    async def receive(
        self,
        request: rollout_pb2.TransferWeightsRequest,
        entries: Sequence[Entry],
        timeout_s: float,
        recipient: Recipient,
    ) -> Staged:
        """Every byte of the update staged (nothing applied); raises what the transfer failed with."""
        ...


# The cases of TransferWeightsRequest.source, in the contract's order.
SOURCES = [f.name for f in rollout_pb2.TransferWeightsRequest.DESCRIPTOR.oneofs_by_name["source"].fields]


def by_source(receivers: Iterable[Receiver]) -> dict[str, Receiver]:
    """The receivers a server dispatches TransferWeights to, by the `source` case each reads (in the order given:
    the order GetInfo lists their transports in). A case the contract lacks, or one taken twice, is refused."""
    out: dict[str, Receiver] = {}
    for r in receivers:
        if r.source not in SOURCES or r.source in out:
            raise ValueError(f"receiver {type(r).__name__}: source {r.source!r} is not a free case of "
                             f"TransferWeightsRequest.source ({', '.join(SOURCES)})")  # fmt: skip
        out[r.source] = r
    return out


async def gather(
    targets: Sequence[Target], call: Callable[[str, aio.Channel], Awaitable[rollout_pb2.TransferWeightsResponse]]
) -> TransferResults:
    results = await asyncio.gather(*(call(a, ch) for a, ch in targets), return_exceptions=True)
    return {a: r for (a, _), r in zip(targets, results, strict=True)}


def transfer_request(update: Update, version: int, timeout_s: float) -> rollout_pb2.TransferWeightsRequest:
    req = rollout_pb2.TransferWeightsRequest(
        tensors=update.specs, policy_version=version, total_bytes=update.sent_bytes, delta_base_version=update.base
    )
    req.timeout.FromNanoseconds(int(timeout_s * 1e9))
    return req


async def call_transfer(
    channel: aio.Channel, request: rollout_pb2.TransferWeightsRequest, timeout_s: float
) -> rollout_pb2.TransferWeightsResponse:
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    response: rollout_pb2.TransferWeightsResponse = await stub.TransferWeights(request, timeout=timeout_s + 10)
    return response
