"""Trainer side of weight updates: pick the data plane per call, send, and report each server's outcome.

gRPC is the control plane (`GetInfo` says what a server accepts, `TransferWeights` carries the manifest, the
version and the rendezvous); the bytes go on the fastest plane every target supports:
ipc (CUDA tensors, every server on their GPU) > shm (all on this host) > dist (a torch.distributed broadcast) >
grpc (chunks on `UpdateWeights`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch
from grpc import aio

from rewardmesh.common.allocator import keep_freed_memory
from rewardmesh.common.planes import cuda_ipc
from rewardmesh.common.planes import delta as weight_delta
from rewardmesh.common.planes.base import Sender, Target, TransferResult, TransferResults, Update
from rewardmesh.common.planes.cuda_ipc import IpcSender
from rewardmesh.common.planes.digests import digest
from rewardmesh.common.planes.dist import DistSender, dist_available
from rewardmesh.common.planes.grpc_chunks import GrpcSender
from rewardmesh.common.planes.layout import DEFAULT_BUCKET_BYTES, LAYOUT_VERSION
from rewardmesh.common.planes.manifest import manifest
from rewardmesh.common.planes.shm import ShmSender, host_id
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "ipc", "shm", "dist", "grpc")


class WeightSyncError(RuntimeError):
    """A weight update failed on some servers; `failed` maps each one's address to what went wrong."""

    def __init__(self, message: str, failed: Mapping[str, str]) -> None:
        super().__init__(message)
        self.failed = dict(failed)


@dataclass
class SyncResult:
    """What one update_weights call did. num_bytes: the update's size; sent_bytes: what travelled on the data
    plane (less when only the changed elements did); changed: the fraction of elements that changed (-1: whole)."""

    transport: str
    version: int
    num_bytes: int
    seconds: float
    servers: dict[str, rollout_pb2.TransferWeightsResponse]
    sent_bytes: int = 0
    changed: float = -1.0


def _stale(outcome: TransferResult) -> bool:
    """The server refused a delta: it serves another version than the one the delta was made against."""
    return isinstance(outcome, aio.AioRpcError) and outcome.code() == grpc.StatusCode.FAILED_PRECONDITION


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class WeightSync:
    """Chooses a plane per update, prepares the update (digests, a delta), hands it to that plane's sender (which
    keeps what outlives one update: the TCP store and process group, the shm file) and reports each server's outcome.

    share_host: dist servers next to each other in the chain on one host serve one copy of the weights, which the
    first receives into /dev/shm (see common.planes.dist.SharedWeights); False: each receives its own bytes."""

    def __init__(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        dist_host: str | None = None,
        share_host: bool = True,
        verify: bool = True,
        delta: bool = False,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        # A digest of every tensor, which each server checks over what it is about to serve (see common.planes.digests).
        self.verify = verify
        # Opt in: keep a copy of the last version sent (CPU tensors only: one more copy of the weights in memory),
        # and send servers that serve it only the changed elements (common.planes.delta). Off by default: the
        # comparison is a pass over the weights that a fast link (one host, loopback) outruns.
        self.delta = delta
        self._base: dict[str, torch.Tensor] | None = None
        self._base_version = -1
        self.timeout_s = timeout_s
        self.dist_host = dist_host
        self.share_host = share_host
        self.host_id = host_id()
        # the planes whose senders keep something between updates (the grpc one keeps nothing: one per update)
        self._senders: dict[str, Sender] = {"ipc": IpcSender(self), "shm": ShmSender(self), "dist": DistSender(self)}

    def close(self) -> None:
        self._base = None
        for sender in self._senders.values():
            sender.close()

    # -- choosing ------------------------------------------------------------------------------

    async def infos(self, targets: Sequence[tuple[str, aio.Channel]]) -> list[rollout_pb2.GetInfoResponse]:
        request = rollout_pb2.GetInfoRequest()
        stubs = [rollout_pb2_grpc.RolloutServiceStub(ch) for _, ch in targets]
        return list(await asyncio.gather(*(s.GetInfo(request, timeout=self.timeout_s) for s in stubs)))

    def choose(self, infos: Sequence[rollout_pb2.GetInfoResponse], device: torch.device) -> str:
        """auto: the fastest data plane every target supports (servers that predate the field: grpc)."""
        offered = [set(i.weight_transports) or {rollout_pb2.WEIGHT_TRANSPORT_GRPC} for i in infos]
        ipc = rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC
        if device.type == "cuda" and all(ipc in o and i.cuda_device_uuid == cuda_ipc.device_uuid(device)
                                         for o, i in zip(offered, infos, strict=True)):  # fmt: skip
            return "ipc"
        shm = rollout_pb2.WEIGHT_TRANSPORT_SHM
        local = [shm in o and i.host_id == self.host_id for o, i in zip(offered, infos, strict=True)]
        if device.type == "cpu" and self.host_id and all(local):
            return "shm"
        dist = rollout_pb2.WEIGHT_TRANSPORT_DIST
        same_layout = all(i.dist_layout == LAYOUT_VERSION for i in infos)  # older servers unpack another layout
        if dist_available() and same_layout and all(dist in o for o in offered):
            return "dist"
        return "grpc"

    # -- sending -------------------------------------------------------------------------------

    async def push(
        self,
        targets: Sequence[tuple[str, aio.Channel]],
        state: Mapping[str, torch.Tensor],
        version: int,
        transport: str = "auto",
        *,
        chunk_bytes: int = 16 << 20,
        infos: Sequence[rollout_pb2.GetInfoResponse] | None = None,
    ) -> SyncResult:
        """Send `state` as `version` to every target; WeightSyncError names each server that did not apply it.

        infos: each target's GetInfo answer when the caller just asked (one round trip per update, not two).
        Servers that serve the version this client sent last get only the changed elements (`delta`); a server
        that refuses the delta (it serves another version by now) gets the whole weights at once."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if not targets:
            raise ValueError("no rollout servers to send weights to")
        started = time.perf_counter()
        manifest(state)  # a dtype no data plane carries is the caller's error, before anything is sent
        device = next(iter(state.values())).device if state else torch.device("cpu")
        if infos is None or len(infos) != len(targets):
            wanted = transport in ("auto", "dist") or self._base is not None
            infos = await self.infos(targets) if wanted else []
        if transport == "auto":
            transport = self.choose(infos, device)
        ahead = {a: f"INVALID_ARGUMENT: serves version {i.policy_version}, not below {version}"
                 for (a, _), i in zip(targets, infos, strict=False) if i.policy_version >= version}  # fmt: skip
        if ahead:  # it would refuse: not even a chain is formed
            text = "; ".join(f"{a}: {p}" for a, p in ahead.items())
            raise WeightSyncError(f"weight update to version {version} refused on {text}", ahead)
        update = await asyncio.to_thread(self._prepare, state, transport, infos)
        outcomes = await self._send(targets, update, version, transport, chunk_bytes, infos)
        # (a dist chain refused in its check round sends nothing to anyone: those get the whole weights too)
        stale = [(a, ch) for a, ch in targets if update.base and (a not in outcomes or _stale(outcomes[a]))]
        if stale:  # they serve another version by now: the whole weights, to exactly those
            log.info("%d server(s) refused a delta against version %d: sending them the whole weights", len(stale),
                     update.base)  # fmt: skip
            whole = await asyncio.to_thread(self._prepare, state, "", [])
            info_of = {a: i for (a, _), i in zip(targets, infos, strict=False)}
            again = [info_of[a] for a, _ in stale if a in info_of]
            outcomes.update(await self._send(stale, whole, version, transport, chunk_bytes, again))
        failed = {a: _describe(o) for a, o in outcomes.items() if isinstance(o, BaseException)}
        failed.update({a: "not sent: another server refused the update first" for a, _ in targets if a not in outcomes})
        wrong = {a: f"applied version {o.policy_version}" for a, o in outcomes.items()
                 if not isinstance(o, BaseException) and o.policy_version != version}  # fmt: skip
        if failed or wrong:
            self._base = None  # servers now differ: the next update goes whole
            problems = {**failed, **wrong}
            text = "; ".join(f"{a}: {p}" for a, p in problems.items())
            raise WeightSyncError(f"weight update to version {version} over {transport} failed on {text}", problems)
        await asyncio.to_thread(self._keep, state, update, version)
        done = {a: o for a, o in outcomes.items() if not isinstance(o, BaseException)}
        total = sum(t.numel() * t.element_size() for t in state.values())
        return SyncResult(transport, version, total, time.perf_counter() - started, done, update.sent_bytes,
                          update.changed)  # fmt: skip

    async def _send(
        self,
        targets: Sequence[Target],
        update: Update,
        version: int,
        transport: str,
        chunk_bytes: int,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> TransferResults:
        """The chosen plane's sender carries the bytes; each server's outcome comes back, failures included."""
        sender: Sender
        if transport == "grpc":
            keep_freed_memory()  # this process churns through message buffers: recycle them
            sender = GrpcSender(self, chunk_bytes)
        else:
            sender = self._senders[transport]
        return await sender.send(targets, update, version, infos)

    def _prepare(
        self,
        state: Mapping[str, torch.Tensor],
        transport: str,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> Update:
        """Digests, and a delta against the version every target serves where this client still holds it."""
        specs = manifest(state)
        if self.verify:
            for spec, t in zip(specs, state.values(), strict=True):
                spec.digest = digest(t.detach())
        update = Update(specs, {n: t.detach() for n, t in state.items()})
        base = self._base
        usable = (
            self.delta and base is not None and transport in ("grpc", "shm", "dist") and bool(infos)
            and all(i.weight_delta and i.policy_version == self._base_version for i in infos)
            and base.keys() == state.keys()
            and all(t.device.type == "cpu" and t.dtype == base[n].dtype and t.shape == base[n].shape
                    for n, t in state.items())
        )  # fmt: skip
        if not usable:
            return update
        assert base is not None
        update.base, update.changes = self._base_version, {}
        changed = elements = 0
        for spec, (name, t) in zip(specs, state.items(), strict=True):
            old = weight_delta.bits(base[name])
            change = weight_delta.diff(old, weight_delta.bits(t.detach().contiguous()))
            changed, elements = changed + change.positions.size, elements + old.size
            update.changes[name] = change
            encoded = weight_delta.encode(old, change)
            if encoded is not None:
                encoding, payload = encoded
                spec.encoding, spec.encoded_bytes = encoding, payload.size  # type: ignore[assignment]
                update.wire[name] = torch.from_numpy(payload)
        update.changed = changed / max(elements, 1)
        if not any(spec.encoding for spec in specs):  # every tensor changed densely: a whole update after all
            update.base, update.changes = 0, None
        return update

    def _keep(self, state: Mapping[str, torch.Tensor], update: Update, version: int) -> None:
        """The version every server serves now, as this client's own copy (what the next delta is made against)."""
        if not self.delta or not state or any(t.device.type != "cpu" for t in state.values()):
            self._base = None
            return
        if update.changes is not None and self._base is not None:
            for name, change in update.changes.items():
                weight_delta.apply(weight_delta.bits(self._base[name]), change)
        elif self._base is not None and state.keys() < self._base.keys():  # a part of the weights
            for name, t in state.items():
                if self._base[name].dtype == t.dtype and self._base[name].shape == t.shape:
                    self._base[name].copy_(t.detach())
                else:
                    self._base[name] = t.detach().clone()
        else:
            self._base = {name: t.detach().clone() for name, t in state.items()}
        self._base_version = version
