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

import grpc
import torch
from grpc import aio

from rewardmesh.common.planes import cuda_ipc
from rewardmesh.common.planes import delta as weight_delta
from rewardmesh.common.planes.digests import digest
from rewardmesh.common.planes.dist import Store, dist_available, form_group, local_address_towards, send_buckets
from rewardmesh.common.planes.grpc_chunks import iter_update_requests, keep_freed_memory
from rewardmesh.common.planes.layout import DEFAULT_BUCKET_BYTES, LAYOUT_VERSION, layout
from rewardmesh.common.planes.manifest import manifest
from rewardmesh.common.planes.shm import ShmWriter, host_id
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
    """What one update_weights call did. num_bytes: the update's size; sent_bytes: what travelled on the data
    plane (less when only the changed elements did); changed: the fraction of elements that changed (-1: whole)."""

    transport: str
    version: int
    num_bytes: int
    seconds: float
    servers: dict[str, rollout_pb2.TransferWeightsResponse]
    sent_bytes: int = 0
    changed: float = -1.0


@dataclass
class _Update:
    """One update as it travels: the manifest (with digests and encodings), each tensor's bytes on the wire (a
    delta's bytes in place of a tensor), and the changes a delta made (to bring the trainer's copy up to date)."""

    specs: list[rollout_pb2.WeightSpec]
    wire: dict[str, torch.Tensor]
    base: int = 0
    changes: dict[str, weight_delta.Change] | None = None
    changed: float = -1.0

    @property
    def sent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.wire.values())


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


def _stale(outcome: Any) -> bool:
    """The server refused a delta: it serves another version than the one the delta was made against."""
    return isinstance(outcome, aio.AioRpcError) and outcome.code() == grpc.StatusCode.FAILED_PRECONDITION


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
        verify: bool = True,
        delta: bool = True,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        # A digest of every tensor, which each server checks over what it is about to serve (see common.weights).
        self.verify = verify
        # Keep a copy of the last version sent (CPU tensors only: one more copy of the weights in memory), and send
        # servers that serve it only the changed elements (common.weight_delta).
        self.delta = delta
        self._base: dict[str, torch.Tensor] | None = None
        self._base_version = -1
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
        self._base = None
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
        targets: Sequence[tuple[str, aio.Channel]],
        update: _Update,
        version: int,
        transport: str,
        chunk_bytes: int,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> dict[str, Any]:
        if transport == "grpc":  # each message is built once and sent to every server
            keep_freed_memory()
            messages = iter_update_requests(
                update.wire, version, chunk_bytes, specs=update.specs, delta_base=update.base
            )
            fanout = Fanout(messages, [a for a, _ in targets])
            return await self._gather(targets, lambda a, ch: self._grpc(ch, fanout, a))
        if transport == "shm":
            return await self._send_shm(targets, update, version)
        if transport == "ipc":
            return await self._send_ipc(targets, update, version)
        return await self._send_dist(targets, update, version, infos)

    def _prepare(
        self,
        state: Mapping[str, torch.Tensor],
        transport: str,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> _Update:
        """Digests, and a delta against the version every target serves where this client still holds it."""
        specs = manifest(state)
        if self.verify:
            for spec, t in zip(specs, state.values(), strict=True):
                spec.digest = digest(t.detach())
        update = _Update(specs, {n: t.detach() for n, t in state.items()})
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

    def _keep(self, state: Mapping[str, torch.Tensor], update: _Update, version: int) -> None:
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

    def _request(self, update: _Update, version: int) -> rollout_pb2.TransferWeightsRequest:
        req = rollout_pb2.TransferWeightsRequest(
            tensors=update.specs, policy_version=version, total_bytes=update.sent_bytes, delta_base_version=update.base
        )
        req.timeout.FromNanoseconds(int(self.timeout_s * 1e9))
        return req

    async def _call(self, channel: aio.Channel, request: rollout_pb2.TransferWeightsRequest) -> Any:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return await stub.TransferWeights(request, timeout=self.timeout_s + 10)

    async def _send_shm(
        self, targets: Sequence[tuple[str, aio.Channel]], update: _Update, version: int
    ) -> dict[str, Any]:
        tensors = list(update.wire.values())
        (bucket,) = layout([t.numel() * t.element_size() for t in tensors], bucket_bytes=1 << 62, alone_bytes=1 << 62)
        if self._shm is None:
            self._shm = ShmWriter()
        shm = self._shm
        await asyncio.to_thread(shm.write, tensors, bucket.offsets, bucket.nbytes)
        request = self._request(update, version)
        request.shm.path = str(shm.path)
        request.shm.offsets.extend(bucket.offsets)
        outcomes = await self._gather(targets, lambda a, ch: self._call(ch, request))
        if any(isinstance(o, BaseException) for o in outcomes.values()):
            shm.rotate()  # a server that gave up late may still read the old file
        return outcomes

    async def _send_ipc(
        self, targets: Sequence[tuple[str, aio.Channel]], update: _Update, version: int
    ) -> dict[str, Any]:
        """CUDA IPC: the servers read our tensors where they lie; they stay referenced (and unchanged: the caller
        awaits this) until every server has answered."""
        tensors = list(update.wire.values())
        if not tensors or not all(t.is_cuda for t in tensors):
            raise ValueError("transport='ipc' shares CUDA tensors: move the state dict to the servers' GPU first")
        request = self._request(update, version)
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
        update: _Update,
        version: int,
        infos: Sequence[rollout_pb2.GetInfoResponse],
    ) -> dict[str, Any]:
        tensors = list(update.wire.values())
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
        base = self._request(update, version)
        base.dist.CopyFrom(rollout_pb2.DistRendezvous(host=host, port=store.port, group=self._group_name,
                                                      world_size=len(targets) + 1, backend=backend,
                                                      bucket_bytes=self.bucket_bytes, chain=chain,
                                                      layout=LAYOUT_VERSION))  # fmt: skip
        # Neighbours in the chain on one host share one copy of the weights: the first receives it, the next maps it.
        # (A chain has one answer per target, in rank order.) shared[i]: rank i + 1 shares with rank i + 2.
        # (A delta is small, and each server decodes it into memory of its own: nothing to share.)
        sharing = chain and self.share_host and not update.base
        shared = [sharing and bool(x.host_id) and x.host_id == y.host_id and x.dist_host_share
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
        if self._group is None or signature != self._validated or update.base:  # (a delta: each server's base)
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
