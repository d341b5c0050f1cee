"""Rollout-server side of weight updates: check the manifest, receive on the chosen data plane, then apply.

Nothing reaches the backend until every byte of the update is staged: a transfer that fails or times out
in the middle leaves the old weights serving. The backend applies the staged tensors atomically with respect
to decoding (between micro-batches / engine steps) and sets the new policy version.

Peak extra memory during an update: the staged weights (dist: the received buckets, which the typed tensors
are views of; grpc: one preallocated tensor per name; shm: nothing, the trainer's file is mapped).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import torch

from client.tensors import duration_seconds
from client.weight_planes import dist_available, form_group, host_id, map_shm, receive_buckets
from client.weights import WeightAssembler, check_manifest, layout
from reward_engine.errors import InvalidInput, Unavailable
from rewardmesh.v1 import rollout_pb2
from server.backends.base import Backend

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


class WeightReceiver:
    """One update at a time; keeps the process groups trainers formed (a few, most recent first), since a
    trainer keeps its group while its servers stay the same and sends only the group's name again."""

    MAX_GROUPS = 4

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.host_id = host_id()
        self.instance_id = uuid.uuid4().hex
        self._lock = asyncio.Lock()
        # CPU staging buffers of the last dist layout, reused by the next update of the same layout: it then
        # costs no page faults (the staged weights stay allocated between updates; a new layout frees them).
        self._staging: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        self._groups: OrderedDict[tuple[str, int, str, int, int, str], Any] = OrderedDict()

    def transports(self) -> list[Any]:
        out: list[Any] = []
        if self.host_id:
            out.append(rollout_pb2.WEIGHT_TRANSPORT_SHM)
        # dist needs a backend that says where its weights live (hf); vLLM's engine would need its own
        # weight-transfer engine on both sides (not built yet), so a vLLM server takes shm or grpc.
        if dist_available() and isinstance(getattr(self.backend, "device", None), torch.device):
            out.append(rollout_pb2.WEIGHT_TRANSPORT_DIST)
        out.append(rollout_pb2.WEIGHT_TRANSPORT_GRPC)
        return out

    def _device(self) -> torch.device:
        device = getattr(self.backend, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    async def _apply(self, tensors: dict[str, torch.Tensor], version: int) -> tuple[int, float]:
        version = version or self.backend.policy_version + 1
        started = time.perf_counter()
        await self.backend.update_weights(tensors, version)
        return self.backend.policy_version, time.perf_counter() - started

    async def receive_chunks(
        self, requests: AsyncIterator[rollout_pb2.UpdateWeightsRequest]
    ) -> rollout_pb2.UpdateWeightsResponse:
        """The UpdateWeights stream: chunks into preallocated tensors, every chunk checked as it arrives."""
        assembler = WeightAssembler(self.backend.weight_specs())
        version, first = 0, True
        async for msg in requests:
            if first:
                version, first = msg.policy_version, False
                if msg.manifest:
                    assembler.expect(msg.manifest)
            assembler.add(msg.chunk)
        tensors = assembler.finish()
        async with self._lock:
            applied, spent = await self._apply(tensors, version)
        log.info("applied %d tensors (%d bytes) from grpc as policy version %d in %.3fs",
                 len(tensors), assembler.num_bytes, applied, spent)  # fmt: skip
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=applied, num_tensors=len(tensors), num_bytes=assembler.num_bytes, apply_seconds=spent
        )

    async def transfer(self, request: rollout_pb2.TransferWeightsRequest) -> rollout_pb2.TransferWeightsResponse:
        """TransferWeights: validate the manifest first (INVALID_ARGUMENT naming the tensor), then receive, apply."""
        started = time.perf_counter()
        entries = check_manifest(request.tensors, self.backend.weight_specs(), request.total_bytes)
        which = request.WhichOneof("source")
        if which is None:
            raise InvalidInput("source: set dist or shm (gRPC chunks go on UpdateWeights)")
        if request.validate_only:
            return rollout_pb2.TransferWeightsResponse(policy_version=self.backend.policy_version)
        timeout_s = duration_seconds(request.timeout) if request.HasField("timeout") else DEFAULT_TIMEOUT_S
        async with self._lock:
            if which == "shm":
                if not self.host_id:
                    raise InvalidInput("shm: this server has no usable /dev/shm")
                tensors = await asyncio.to_thread(map_shm, request.shm.path, entries, list(request.shm.offsets))
            else:
                tensors = await self._receive_dist(request.dist, entries, timeout_s)
            applied, spent = await self._apply(tensors, request.policy_version)
        total = sum(e.nbytes for e in entries)
        seconds = time.perf_counter() - started
        log.info("applied %d tensors (%d bytes) from %s as policy version %d in %.3fs (apply %.3fs)",
                 len(entries), total, which, applied, seconds, spent)  # fmt: skip
        return rollout_pb2.TransferWeightsResponse(
            policy_version=applied, num_tensors=len(entries), num_bytes=total, seconds=seconds, apply_seconds=spent
        )

    async def _receive_dist(
        self, rdv: rollout_pb2.DistRendezvous, entries: list[Any], timeout_s: float
    ) -> dict[str, torch.Tensor]:
        if not dist_available():
            raise InvalidInput("dist: torch.distributed (gloo) is not available on this server")
        if rdv.backend not in ("gloo", "nccl"):
            raise InvalidInput(f"dist.backend: {rdv.backend!r} is not gloo or nccl")
        if not 0 < rdv.rank < rdv.world_size:
            raise InvalidInput(f"dist.rank: {rdv.rank} is not in 1..{rdv.world_size - 1}")
        if rdv.bucket_bytes < 1:
            raise InvalidInput(f"dist.bucket_bytes must be >= 1, got {rdv.bucket_bytes}")
        device = self._device() if rdv.backend == "nccl" else torch.device("cpu")
        key = (rdv.host, rdv.port, rdv.group, rdv.rank, rdv.world_size, rdv.backend)
        buckets = layout([e.nbytes for e in entries], rdv.bucket_bytes)
        group = self._groups.pop(key, None)  # kept again only if this transfer succeeds
        sizes = tuple(b.nbytes for b in buckets)
        if device.type != "cpu":
            buffers: list[torch.Tensor] = []
        elif self._staging is not None and self._staging[0] == sizes:
            buffers = self._staging[1]
        else:
            self._staging = None
            buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]

        def receive() -> dict[str, torch.Tensor]:
            pg = group
            if pg is None:
                pg = form_group(host=rdv.host, port=rdv.port, group=rdv.group, rank=rdv.rank,
                                world_size=rdv.world_size, backend=rdv.backend, timeout_s=timeout_s)  # fmt: skip
            staged = receive_buckets(pg, entries, buckets, device, timeout_s, buffers)
            self._groups[key] = pg
            while len(self._groups) > self.MAX_GROUPS:
                self._groups.popitem(last=False)
            return staged

        try:
            staged = await asyncio.to_thread(receive)
            if buffers:
                self._staging = (sizes, buffers)
            return staged
        except RuntimeError as exc:  # gloo/NCCL: a peer went away or a wait timed out; nothing was applied
            self._staging = None  # a late write may still land in these buffers: never reuse them
            text = f"dist: receiving the weights from {rdv.host}:{rdv.port} failed, nothing applied: {exc}"
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(text) from exc
            raise Unavailable(text) from exc
