"""Trainer side of weight updates: pick the data plane per call, send, and report each server's outcome.

gRPC is the control plane (`GetInfo` says what a server accepts, `TransferWeights` carries the manifest, the
version and the rendezvous); the bytes go on the fastest plane every target supports:
ipc (CUDA tensors, every server on their GPU) > shm (all on this host) > dist (a torch.distributed broadcast) >
grpc (chunks on `UpdateWeights`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from grpc import aio

from rewardmesh.common import cuda_ipc
from rewardmesh.common.weight_planes import (
    ShmWriter,
    Store,
    dist_available,
    form_group,
    host_id,
    keep_freed_memory,
    local_address_towards,
    send_buckets,
)
from rewardmesh.common.weights import DEFAULT_BUCKET_BYTES, LAYOUT_VERSION, iter_update_requests, layout, manifest
from rewardmesh.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "ipc", "shm", "dist", "grpc")
_UPDATE_WEIGHTS = "/rewardmesh.v1.RolloutService/UpdateWeights"


class Fanout:
    """One stream of messages to several consumers, each at its own pace, but never more than `window` messages
    ahead of the slowest one still reading: the trainer holds `window` messages (16 MiB each by default), not
    the whole serialized model while one server lags (14 GB for a 7B model). A consumer that stops (its call
    failed, or timed out) leaves, and the others go on."""

    def __init__(self, source: Iterator[bytes], consumers: Sequence[str], window: int = 4) -> None:
        self._source = source
        self._queues = {c: asyncio.Queue[bytes | None](maxsize=window) for c in consumers}
        self._producer: asyncio.Task[None] | None = None
        self._error: Exception | None = None

    async def _produce(self) -> None:
        try:
            for message in itertools.chain(self._source, [None]):  # None: the end
                for c, q in list(self._queues.items()):
                    if c in self._queues:  # it may have left while this waited on another's queue
                        await q.put(message)
                if not self._queues:
                    return
        except Exception as exc:  # building a message failed: every consumer hears it, none waits on
            self._error = exc
            for q in self._queues.values():
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)

    async def messages(self, consumer: str) -> AsyncIterator[bytes]:
        if self._producer is None:
            self._producer = asyncio.get_running_loop().create_task(self._produce())
        q = self._queues[consumer]
        while (message := await q.get()) is not None:
            yield message
        if self._error is not None:
            raise self._error

    def leave(self, consumer: str) -> None:
        q = self._queues.pop(consumer, None)
        while q is not None and not q.empty():  # a put waiting on its full queue goes through
            q.get_nowait()
        if not self._queues and self._producer is not None:
            self._producer.cancel()


class WeightSyncError(RuntimeError):
    """A weight update failed on some servers; `failed` maps each one's address to what went wrong."""

    def __init__(self, message: str, failed: Mapping[str, str]) -> None:
        super().__init__(message)
        self.failed = dict(failed)


@dataclass
class SyncResult:
    """What one update_weights call did."""

    transport: str
    version: int
    num_bytes: int
    seconds: float
    servers: dict[str, rollout_pb2.TransferWeightsResponse]


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class WeightSync:
    """Keeps what outlives one update: the TCP store, the process group of the current servers, the shm file.

    share_host: dist servers next to each other in the chain on one host serve one copy of the weights, which the
    first receives into /dev/shm (see common.weight_planes.SharedWeights); False: each receives its own bytes."""

    def __init__(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        dist_host: str | None = None,
        share_host: bool = True,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.dist_host = dist_host
        self.share_host = share_host
        self.host_id = host_id()
        self._store: Store | None = None
        self._group: Any = None
        self._members: tuple[str, ...] = ()  # address#instance of every server in the kept group
        self._group_name = ""
        self._shm: ShmWriter | None = None
        self._validated: tuple[str, tuple[Any, ...]] | None = None

    def close(self) -> None:
        self._group = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None

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

        infos: each target's GetInfo answer when the caller just asked (one round trip per update, not two)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if not targets:
            raise ValueError("no rollout servers to send weights to")
        started = time.perf_counter()
        manifest(state)  # a dtype no data plane carries is the caller's error, before anything is sent
        device = next(iter(state.values())).device if state else torch.device("cpu")
        if infos is None or len(infos) != len(targets):
            infos = await self.infos(targets) if transport in ("auto", "dist") else []
        if transport == "auto":
            transport = self.choose(infos, device)
        if transport == "grpc":  # each message is built once and sent to every server
            keep_freed_memory()
            fanout = Fanout(iter_update_requests(state, version, chunk_bytes), [a for a, _ in targets])
            outcomes = await self._gather(targets, lambda a, ch: self._grpc(ch, fanout, a))
        elif transport == "shm":
            outcomes = await self._send_shm(targets, state, version)
        elif transport == "ipc":
            outcomes = await self._send_ipc(targets, state, version)
        else:
            outcomes = await self._send_dist(targets, state, version, infos)
        failed = {a: _describe(o) for a, o in outcomes.items() if isinstance(o, BaseException)}
        wrong = {a: f"applied version {o.policy_version}" for a, o in outcomes.items()
                 if not isinstance(o, BaseException) and o.policy_version != version}  # fmt: skip
        if failed or wrong:
            problems = {**failed, **wrong}
            text = "; ".join(f"{a}: {p}" for a, p in problems.items())
            raise WeightSyncError(f"weight update to version {version} over {transport} failed on {text}", problems)
        done = {a: o for a, o in outcomes.items() if not isinstance(o, BaseException)}
        total = sum(t.numel() * t.element_size() for t in state.values())
        return SyncResult(transport, version, total, time.perf_counter() - started, done)

    async def _gather(self, targets: Sequence[tuple[str, aio.Channel]], call: Any) -> dict[str, Any]:
        results = await asyncio.gather(*(call(a, ch) for a, ch in targets), return_exceptions=True)
        return {a: r for (a, _), r in zip(targets, results, strict=True)}

    async def _grpc(self, channel: aio.Channel, fanout: Fanout, address: str) -> rollout_pb2.TransferWeightsResponse:
        call = channel.stream_unary(_UPDATE_WEIGHTS, request_serializer=None,
                                    response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString)  # fmt: skip
        try:
            r = await call(fanout.messages(address), timeout=self.timeout_s)
        finally:
            fanout.leave(address)  # a failed server holds the others back no longer
        return rollout_pb2.TransferWeightsResponse(policy_version=r.policy_version, num_tensors=r.num_tensors,
                                                   num_bytes=r.num_bytes, apply_seconds=r.apply_seconds)  # fmt: skip

    def _request(self, state: Mapping[str, torch.Tensor], version: int) -> rollout_pb2.TransferWeightsRequest:
        total = sum(t.numel() * t.element_size() for t in state.values())
        req = rollout_pb2.TransferWeightsRequest(tensors=manifest(state), policy_version=version, total_bytes=total)
        req.timeout.FromNanoseconds(int(self.timeout_s * 1e9))
        return req

    async def _call(self, channel: aio.Channel, request: rollout_pb2.TransferWeightsRequest) -> Any:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return await stub.TransferWeights(request, timeout=self.timeout_s + 10)

    async def _send_shm(
        self, targets: Sequence[tuple[str, aio.Channel]], state: Mapping[str, torch.Tensor], version: int
    ) -> dict[str, Any]:
        tensors = [t.detach() for t in state.values()]
        (bucket,) = layout([t.numel() * t.element_size() for t in tensors], bucket_bytes=1 << 62, alone_bytes=1 << 62)
        if self._shm is None:
            self._shm = ShmWriter()
        shm = self._shm
        await asyncio.to_thread(shm.write, tensors, bucket.offsets, bucket.nbytes)
        request = self._request(state, version)
        request.shm.path = str(shm.path)
        request.shm.offsets.extend(bucket.offsets)
        outcomes = await self._gather(targets, lambda a, ch: self._call(ch, request))
        if any(isinstance(o, BaseException) for o in outcomes.values()):
            shm.rotate()  # a server that gave up late may still read the old file
        return outcomes

    async def _send_ipc(
        self, targets: Sequence[tuple[str, aio.Channel]], state: Mapping[str, torch.Tensor], version: int
    ) -> dict[str, Any]:
        """CUDA IPC: the servers read our tensors where they lie; they stay referenced (and unchanged: the caller
        awaits this) until every server has answered."""
        tensors = [t.detach() for t in state.values()]
        if not tensors or not all(t.is_cuda for t in tensors):
            raise ValueError("transport='ipc' shares CUDA tensors: move the state dict to the servers' GPU first")
        request = self._request(state, version)
        request.cuda_ipc.CopyFrom(cuda_ipc.handles(tensors))
        torch.cuda.synchronize(tensors[0].device)  # the servers read what the last kernel wrote
        return await self._gather(targets, lambda a, ch: self._call(ch, request))

    def _rendezvous_host(self, targets: Sequence[tuple[str, aio.Channel]]) -> str:
        if self.dist_host:
            return self.dist_host
        hosts = [_host(a) for a, _ in targets]
        if all(_is_loopback(h) for h in hosts):
            return "127.0.0.1"
        return local_address_towards(next(h for h in hosts if not _is_loopback(h)))

    async def _send_dist(
        self,
        targets: Sequence[tuple[str, aio.Channel]],
        state: Mapping[str, torch.Tensor],
        version: int,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> dict[str, Any]:
        tensors = [t.detach() for t in state.values()]
        backend = "nccl" if tensors and tensors[0].is_cuda else "gloo"
        # gloo: a chain of point-to-point sends (the trainer sends every byte once; gloo's sends cost far less per
        # call than its broadcasts). NCCL's broadcast is a pipelined ring already: one call per bucket.
        chain = backend == "gloo" and len(infos) == len(targets) and all(i.dist_chain for i in infos)
        if chain:  # the servers of one host next to each other, so that they share one copy (stable: same order)
            order = sorted(range(len(targets)), key=lambda i: infos[i].host_id)
            targets, infos = [targets[i] for i in order], [infos[i] for i in order]
        instances = [i.instance_id for i in infos]
        # A server that restarted (new instance id) holds none of our groups: that is a membership change too.
        members = tuple(f"{a}#{i}" for (a, _), i in zip(targets, instances, strict=True))
        host = self._rendezvous_host(targets)
        if self._store is None or self._store.host != host:
            if self._store is not None:
                self._store.close()
            self._store, self._group = Store(host, self.timeout_s), None
        if self._group is None or members != self._members:
            self._group, self._members, self._group_name = None, members, uuid.uuid4().hex[:12]
        store = self._store
        base = self._request(state, version)
        base.dist.CopyFrom(rollout_pb2.DistRendezvous(host=host, port=store.port, group=self._group_name,
                                                      world_size=len(targets) + 1, backend=backend,
                                                      bucket_bytes=self.bucket_bytes, chain=chain,
                                                      layout=LAYOUT_VERSION))  # fmt: skip
        # Neighbours in the chain on one host share one copy of the weights: the first receives it, the next maps it.
        # (A chain has one answer per target, in rank order.) shared[i]: rank i + 1 shares with rank i + 2.
        shared = [chain and self.share_host and bool(x.host_id) and x.host_id == y.host_id and x.dist_host_share
                  and y.dist_host_share for x, y in itertools.pairwise(infos)]  # fmt: skip
        requests = {}
        for rank, (address, _) in enumerate(targets, start=1):
            req = rollout_pb2.TransferWeightsRequest()
            req.CopyFrom(base)
            req.dist.rank = rank
            req.dist.share_with_next = rank <= len(shared) and shared[rank - 1]
            req.dist.share_from_prev = rank >= 2 and shared[rank - 2]
            requests[address] = req
        # Check every manifest first: a server that refuses must not leave the others waiting in a broadcast.
        # The same manifest to the same servers in the same group was accepted last time: no need to ask again.
        signature = (self._group_name, tuple((s.name, s.dtype, tuple(s.shape)) for s in base.tensors))
        if self._group is None or signature != self._validated:
            check = rollout_pb2.TransferWeightsRequest()
            check.CopyFrom(base)
            check.validate_only = True
            refused = {a: o for a, o in (await self._gather(targets, lambda a, ch: self._call(ch, check))).items()
                       if isinstance(o, BaseException)}  # fmt: skip
            if refused:
                return refused
            self._validated = signature
        buckets = layout([t.numel() * t.element_size() for t in tensors], self.bucket_bytes)
        group, world, name = self._group, len(targets) + 1, self._group_name

        def send() -> None:
            pg = group
            if pg is None:
                pg = form_group(host=host, port=store.port, group=name, rank=0, world_size=world, backend=backend,
                                timeout_s=self.timeout_s, store=store.store)  # fmt: skip
            send_buckets(pg, tensors, buckets, self.timeout_s, chain=chain)
            self._group = pg

        self._group = None  # kept again only if this transfer succeeds
        sender = asyncio.ensure_future(asyncio.to_thread(send))
        outcomes = await self._gather(targets, lambda a, ch: self._call(ch, requests[a]))
        try:
            await sender
        except Exception as exc:  # the broadcast broke: name it on every server that did not report success
            self._group = None
            for a, o in outcomes.items():
                if not isinstance(o, BaseException):
                    outcomes[a] = RuntimeError(f"reported success but the broadcast failed: {exc}")
        if any(isinstance(o, BaseException) for o in outcomes.values()):
            self._group = None  # re-formed on the next update
        return outcomes
