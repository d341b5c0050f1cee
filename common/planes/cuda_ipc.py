"""The CUDA IPC data plane: a trainer and a rollout server on one GPU (colocated), nothing copied through the host.

Each tensor's handle is torch's own CUDA reduction (`torch.multiprocessing.reductions.reduce_tensor`) written
out as protobuf fields (`CudaIpcHandle`); the server rebuilds the tensor with torch's `rebuild_cuda_tensor`
from those fields after checking them against the manifest, so nothing from the wire is unpickled. The trainer
keeps its tensors alive (and unchanged) until every server has answered.

Written against torch's and vLLM's documented APIs; it needs a CUDA GPU, which the development machine lacks:
the tests that need one skip there.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import torch

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.planes.base import (
    Recipient,
    Settings,
    Staged,
    Target,
    TransferResults,
    Update,
    call_transfer,
    gather,
    transfer_request,
)
from rewardmesh.common.planes.digests import check_received
from rewardmesh.common.planes.manifest import Entry
from rewardmesh.v1 import rollout_pb2


def device_uuid(device: torch.device | int) -> str:
    """The physical GPU's UUID (stable across processes whatever their CUDA_VISIBLE_DEVICES); "" without CUDA."""
    if not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def handles(tensors: Sequence[torch.Tensor]) -> rollout_pb2.CudaIpcSource:
    """The trainer's side: one handle per tensor (all on one GPU), in order."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensors:
        return rollout_pb2.CudaIpcSource()
    source = rollout_pb2.CudaIpcSource(device_uuid=device_uuid(tensors[0].device))
    for t in tensors:
        if not t.is_cuda or t.device != tensors[0].device:
            raise ValueError(f"cuda_ipc: every tensor must lie on {tensors[0].device}, found one on {t.device}")
        _, args = reduce_tensor(t.detach())
        (_, _, stride, offset, _, _, _, handle, size, storage_offset, _, ref, ref_offset, event, sync) = args
        source.handles.add(storage_handle=handle, storage_size_bytes=size, storage_offset_bytes=storage_offset,
                           stride=list(stride), offset=offset, ref_counter_handle=ref, ref_counter_offset=ref_offset,
                           event_handle=event, event_sync_required=sync)  # fmt: skip
    return source


def check_source(source: rollout_pb2.CudaIpcSource, entries: Sequence[Entry], own_uuid: str) -> None:
    """Everything the server can check before opening a handle; InvalidInput naming the field or the tensor."""
    if not own_uuid:
        raise InvalidInput("cuda_ipc: this server's model is not on a GPU; use transport dist, shm or grpc")
    if source.device_uuid != own_uuid:
        raise InvalidInput(
            f"cuda_ipc.device_uuid: {source.device_uuid!r} is not this server's GPU {own_uuid!r} (CUDA IPC shares "
            "memory on one GPU only); use transport dist"
        )
    if len(source.handles) != len(entries):
        raise InvalidInput(f"cuda_ipc.handles: {len(source.handles)} handles for {len(entries)} tensors")
    for h, e in zip(source.handles, entries, strict=True):
        where = f"cuda_ipc.handles: tensor {e.name!r}"
        if not h.storage_handle or not h.ref_counter_handle:
            raise InvalidInput(f"{where}: empty storage or reference-counter handle")
        if len(h.stride) != len(e.shape) or min((*h.stride, h.offset, h.storage_offset_bytes), default=0) < 0:
            raise InvalidInput(f"{where}: strides {list(h.stride)} and offset {h.offset} do not fit shape {e.shape}")
        last = sum((d - 1) * s for d, s in zip(e.shape, h.stride, strict=True)) if math.prod(e.shape) else -1
        if (h.offset + last + 1) * e.dtype.itemsize > h.storage_size_bytes:
            raise InvalidInput(f"{where}: its elements reach past the shared storage of {h.storage_size_bytes} bytes")


def rebuild_args(h: rollout_pb2.CudaIpcHandle, e: Entry, device_index: int) -> tuple[Any, ...]:
    """The arguments of torch's `rebuild_cuda_tensor`, in its order, from checked fields."""
    return (torch.Tensor, torch.Size(e.shape), tuple(h.stride), h.offset, torch.storage.TypedStorage, e.dtype,
            device_index, h.storage_handle, h.storage_size_bytes, h.storage_offset_bytes, False,
            h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required)  # fmt: skip


def open_tensors(
    source: rollout_pb2.CudaIpcSource, entries: Sequence[Entry], device: torch.device
) -> dict[str, torch.Tensor]:
    """The trainer's tensors, mapped into this process (no copy); valid while the trainer keeps them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = device.index if device.index is not None else torch.cuda.current_device()
    return {
        e.name: rebuild_cuda_tensor(*rebuild_args(h, e, index)) for h, e in zip(source.handles, entries, strict=True)
    }


def check_ipc(source: rollout_pb2.CudaIpcSource, entries: Sequence[Entry], device: torch.device) -> None:
    """Before an engine loads the trainer's tensors itself: their digests and finiteness, over the tensors the
    handles open (WeightsError naming the tensor)."""
    check_received(open_tensors(source, entries, device), entries)


class IpcReceiver:
    """The server's side: the trainer's tensors where they lie (nothing copied, nothing owned: the trainer's
    memory). An engine that opens the handles itself (vLLM) is handed the handles, after the digests are checked
    over the tensors they open."""

    source = "cuda_ipc"
    transport = rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC

    def offered(self, recipient: Recipient) -> bool:
        return bool(recipient.cuda_uuid())

    def check(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], recipient: Recipient
    ) -> None:
        check_source(request.cuda_ipc, entries, recipient.cuda_uuid())
        if any(e.encoding for e in entries):
            raise InvalidInput("tensors: cuda_ipc carries whole tensors, no delta encodings")

    async def receive(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], timeout_s: float,
        recipient: Recipient,
    ) -> Staged:  # fmt: skip
        source, device = request.cuda_ipc, recipient.weights_device or torch.device("cpu")
        if not recipient.loads_cuda_ipc:
            return Staged(open_tensors(source, entries, device))
        if any(e.digest is not None for e in entries):
            await asyncio.to_thread(check_ipc, source, entries, device)
        return Staged({}, handles=source)


class IpcSender:
    """The trainer's side: the servers read our tensors where they lie; they stay referenced (and unchanged: the
    caller awaits this) until every server has answered."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def send(
        self, targets: Sequence[Target], update: Update, version: int, infos: Sequence[rollout_pb2.GetInfoResponse]
    ) -> TransferResults:
        tensors = list(update.wire.values())
        if not tensors or not all(t.is_cuda for t in tensors):
            raise ValueError("transport='ipc' shares CUDA tensors: move the state dict to the servers' GPU first")
        request = transfer_request(update, version, self.settings.timeout_s)
        request.cuda_ipc.CopyFrom(handles(tensors))
        torch.cuda.synchronize(tensors[0].device)  # the servers read what the last kernel wrote
        return await gather(targets, lambda a, ch: call_transfer(ch, request, self.settings.timeout_s))

    def close(self) -> None:
        pass
