"""The dist plane: a torch.distributed process group of its own (never the process-global default group), formed
over a TCP store the trainer hosts, bound to the one address it names; tensors go in buckets, a broadcast each
or a chain of point-to-point sends. dist servers on one host share one copy: the first receives into a file
under /dev/shm (`SharedWeights`), the others in the chain map it and serve from it (`HostShare`).

Every blocking call here (forming a group, a broadcast) runs in a worker thread, never on an event loop.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import fcntl
import ipaddress
import itertools
import logging
import mmap
import os
import socket
import uuid
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rewardmesh.common.errors import InvalidInput, Unavailable
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
from rewardmesh.common.planes.layout import LAYOUT_VERSION, Bucket, aligned, byte_view, layout, views
from rewardmesh.common.planes.manifest import Entry
from rewardmesh.common.planes.shm import SHM_DIR, SHM_PREFIX, sweep_stale_shm, weights_file
from rewardmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)


def dist_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def local_address_towards(host: str) -> str:
    """The local interface address that reaches `host` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


class Store:
    """The trainer's TCP store: listens on exactly one address (never all interfaces), port chosen by the OS."""

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   master_listen_fd=self._sock.fileno())  # fmt: skip
        self._sock.detach()  # the store owns the listening socket now and closes it when it goes

    def close(self) -> None:
        del self.store


def form_group(
    *, host: str, port: int, group: str, rank: int, world_size: int, backend: str, timeout_s: float,
    store: Any = None,
) -> Any:  # fmt: skip
    """A process group of its own over the trainer's store; blocks until every rank joined (or timeout)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"rewardmesh-weights/{group}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        me = host if rank == 0 else local_address_towards(host)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=me)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    if backend == "nccl":  # GPU path: written against torch's documented API, unverified on this machine
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
    raise InvalidInput(f"dist.backend: {backend!r} is not gloo or nccl")


def _broadcast(group: Any, buf: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([buf], opts)


def send_buckets(
    group: Any, tensors: Sequence[torch.Tensor], buckets: Sequence[Bucket], timeout_s: float, *, chain: bool = False
) -> int:
    """Rank 0: every bucket to the servers; returns the bytes sent. At most two packed bucket buffers at a time
    (a tensor of its own bucket goes as it lies, no packing copy).

    chain: point-to-point to rank 1 only (which forwards), every send posted at once; gloo's sends cost far
    less per call than its broadcasts. Otherwise one broadcast per bucket, the next packed while one is on the
    wire."""
    timeout = datetime.timedelta(seconds=timeout_s)
    in_flight: Any = None
    packed: collections.deque[Any] = collections.deque()  # works whose buffers are packing copies
    works: list[Any] = []
    sent = 0
    for b in buckets:
        first = tensors[b.members[0]]
        copy = not (len(b.members) == 1 and first.is_contiguous())
        if not copy:
            buf = byte_view(first)
        else:
            if len(packed) >= 2:  # a gloo send is waited once only (a second wait would block for ever)
                done = packed.popleft()
                done.wait(timeout)
                works = [w for w in works if w is not done]
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=first.device)
            for i, off in zip(b.members, b.offsets, strict=True):
                src = byte_view(tensors[i])
                buf[off : off + src.numel()].copy_(src)
        if chain:
            work = group.send([buf], 1, b.members[0])  # each bucket its own tag, known to both sides
            works.append(work)
        else:
            if in_flight is not None:
                in_flight.wait(timeout)
            work = in_flight = _broadcast(group, buf)
        if copy and chain:  # (broadcasts: one in flight, so at most two packed buffers already)
            packed.append(work)
        sent += b.nbytes
    for work in [*works, in_flight]:
        if work is not None:
            work.wait(timeout)
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize()
    return sent


def receive_buckets(
    group: Any,
    entries: Sequence[Entry],
    buckets: Sequence[Bucket],
    device: torch.device,
    timeout_s: float,
    buffers: Sequence[torch.Tensor] = (),
    *,
    chain: tuple[int, int] | None = None,
    share: HostShare | None = None,
) -> dict[str, torch.Tensor]:
    """Rank > 0: every bucket lands in its staging buffer (`buffers` when given: one per bucket, reused), typed
    tensors are views into it (no copy).

    chain: (rank, world_size): receive from rank - 1, and forward each bucket to rank + 1 as soon as it is in
    while the next arrives. A forward that fails (the next server went away) does not fail this server: its own
    bytes are whole; it raises ForwardFailed after the receive, with the staged tensors.
    share (chain only): neighbours on this host share one copy of the weights (see HostShare)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    staged: dict[str, torch.Tensor] = {}
    failed = False
    if chain is None:
        bufs = _buffers(buckets, buffers, device)
        works = [_broadcast(group, buf) for buf in bufs]
        for work in works:
            work.wait(timeout)
    else:
        rank, world = chain
        nxt, tag = rank + 1 < world, len(entries)  # the file's path message (a bucket's tag: its first member)
        forwards: list[Any] | None = []
        if share is not None and share.from_prev:
            path = _receive_path(group, rank - 1, tag, timeout)
            if path:  # else: the previous server could make no file, the bytes themselves follow
                try:
                    share.file = SharedWeights.open(path, file_offsets(buckets)[1])
                except (InvalidInput, OSError) as exc:  # like a gloo failure: the chain breaks here, nothing applied
                    raise RuntimeError(f"cannot map the previous server's weights file: {exc}") from exc
        file = share.file if share is not None else None  # ours, or the previous server's
        # The next server maps the file only when it shares with us; any other next server gets the bytes.
        notify = file is not None and share is not None and share.to_next
        if share is not None and share.to_next and nxt:  # first: the next server waits for it before anything else
            forwards = _forward(group, forwards, _path_message(file.path if file else None), rank + 1, tag)
        if file is not None and share is not None and share.from_prev:  # the bytes are in the file already
            bufs = file.buckets(buckets)
            into = list(torch.zeros(len(buckets), dtype=torch.uint8).split(1))  # one-byte notices
        else:
            bufs = into = _buffers(buckets, buffers, device)
        notice = torch.ones(1, dtype=torch.uint8)
        works = [group.recv([t], rank - 1, b.members[0]) for t, b in zip(into, buckets, strict=True)]
        for work, buf, b in zip(works, bufs, buckets, strict=True):
            work.wait(timeout)
            if nxt:
                forwards = _forward(group, forwards, notice if notify else buf, rank + 1, b.members[0])
        failed = forwards is None
        for work in forwards or ():
            try:
                work.wait(timeout)
            except RuntimeError as exc:
                log.warning("dist: forwarding weights to rank %d failed: %s", rank + 1, exc)
                failed = True
    for buf, b in zip(bufs, buckets, strict=True):
        staged.update(views(buf, [entries[i] for i in b.members], b.offsets))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if failed:
        raise ForwardFailed(staged)
    return staged


def _buffers(buckets: Sequence[Bucket], given: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if given:
        return list(given)
    return [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in buckets]


def _forward(group: Any, forwards: list[Any] | None, buf: torch.Tensor, to: int, tag: int) -> list[Any] | None:
    """Post one send to the next server of the chain; None once one failed (no more are posted)."""
    if forwards is None:
        return None
    try:
        forwards.append(group.send([buf], to, tag))
    except RuntimeError as exc:
        log.warning("dist: forwarding weights to rank %d failed: %s", to, exc)
        return None
    return forwards


class ForwardFailed(Exception):
    """This server received every byte but could not pass them on to the next in the chain (gone, or timed out):
    its group is broken, its update is not."""

    def __init__(self, staged: dict[str, torch.Tensor]) -> None:
        super().__init__("forwarding to the next server in the chain failed")
        self.staged = staged


def file_offsets(buckets: Sequence[Bucket]) -> tuple[list[int], int]:
    """Where each bucket lies in a SharedWeights file (back to back, aligned), and the file's size."""
    offsets, end = [], 0
    for b in buckets:
        offsets.append(end)
        end += aligned(b.nbytes)
    return offsets, end


def _close_file(fd: int, path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
    os.close(fd)  # drops the lock


class SharedWeights:
    """One update's buckets in a file under /dev/shm, which the dist servers of a host serve from: the first of
    them in the chain receives the bytes into it, the others map it (no copy, and one copy of the weights on the
    host instead of one per server).

    Every process serving from the file holds a shared flock on it, for as long as any tensor of it maps the file
    (a mapping holds a duplicate of the descriptor, and with it the lock). The process that made it writes it again
    only once it can take the lock exclusively (`reusable`): a server whose update failed, still serving the
    older weights, keeps its file from being overwritten, and the maker writes a new file instead. The maker
    unlinks the file when it lets go; whoever still has it mapped keeps reading it. Left by a killed maker, it is
    removed by `sweep_stale_shm` once nobody serves from it."""

    def __init__(self, path: Path, fd: int, data: torch.Tensor, owner: bool) -> None:
        self.path, self.data, self.owner = path, data, owner
        self._finalizer = weakref.finalize(self, _close_file, fd, path if owner else None)
        self._fd = fd

    @classmethod
    def create(cls, size: int) -> SharedWeights:
        """A new file of `size` bytes (OSError when /dev/shm has no room for it, before anything is sent)."""
        sweep_stale_shm()
        name = f"{SHM_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        staging = SHM_DIR / f".{name}"  # locked before it gets a name the sweeper looks at
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, max(size, 1))  # a full /dev/shm fails here, not as SIGBUS on a write
            os.rename(staging, SHM_DIR / name)
            data = torch.frombuffer(mmap.mmap(fd, max(size, 1)), dtype=torch.uint8)[:size]
        except BaseException:
            staging.unlink(missing_ok=True)
            os.close(fd)
            raise
        return cls(SHM_DIR / name, fd, data, owner=True)

    @classmethod
    def open(cls, path: str, size: int) -> SharedWeights:
        """Another server's file, mapped read-only (the model's weights must never write it), pages mapped now."""
        resolved = weights_file(path, "path")
        fd = os.open(resolved, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # its maker holds the lock exclusively only for a moment (`reusable`)
            have = os.fstat(fd).st_size
            if have < size:
                raise InvalidInput(f"{path!r} has {have} bytes, the buckets need {size}")
            mm = mmap.mmap(fd, have, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only on purpose: a write faults instead of changing others' weights
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(mm, dtype=torch.uint8)[:size]
        except BaseException:
            os.close(fd)
            raise
        return cls(resolved, fd, data, owner=False)

    @property
    def size(self) -> int:
        return self.data.numel()

    def buckets(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        offsets, _ = file_offsets(buckets)
        return [self.data[off : off + b.nbytes] for off, b in zip(offsets, buckets, strict=True)]

    def reusable(self) -> bool:
        """Its maker's check before writing it again: no other process serves from it now."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # (Linux dropped our shared lock on the way: the caller lets the file go)
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return True

    def close(self) -> None:
        """Serve from it no longer: the lock goes with the last tensor that maps it; its maker unlinks it."""
        self._finalizer()


@dataclass
class HostShare:
    """A dist chain rank's part in sharing one copy of the weights with its neighbours on the host.

    to_next: rank + 1 runs here and maps our file: send it the file's path first, then a one-byte notice per
    bucket instead of its bytes. from_prev: rank - 1 runs here: receive its path, map the file (`file` is set
    then), then a notice per bucket. An empty path (no room under /dev/shm) means the bytes follow as usual."""

    to_next: bool
    from_prev: bool
    file: SharedWeights | None = None  # to_next alone: ours (None: none could be made); from_prev: theirs


PATH_BYTES = 512  # the path message: utf-8, zero-padded; all zeros: no file


def _path_message(path: Path | None) -> torch.Tensor:
    raw = str(path).encode() if path is not None else b""
    if len(raw) > PATH_BYTES:
        raise ValueError(f"weights file path {path!r} is longer than {PATH_BYTES} bytes")
    msg = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    msg[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return msg


def _receive_path(group: Any, src: int, tag: int, timeout: datetime.timedelta) -> str:
    msg = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    group.recv([msg], src, tag).wait(timeout)
    return bytes(msg.numpy()).rstrip(b"\0").decode(errors="replace")


# --------------------------------------------------------------------------------------------- the trainer


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


class DistSender:
    """The trainer's side, keeping what outlives one update: the TCP store, the process group of the current
    servers (formed again when they change), and the manifest they last accepted in it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._store: Store | None = None
        self._group: Any = None
        self._members: tuple[str, ...] = ()  # address#instance of every server in the kept group
        self._group_name = ""
        self._validated: tuple[str, tuple[Any, ...]] | None = None

    def close(self) -> None:
        self._group = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def _rendezvous_host(self, targets: Sequence[Target]) -> str:
        if self.settings.dist_host:
            return self.settings.dist_host
        hosts = [_host(a) for a, _ in targets]
        if all(_is_loopback(h) for h in hosts):
            return "127.0.0.1"
        return local_address_towards(next(h for h in hosts if not _is_loopback(h)))

    async def send(
        self, targets: Sequence[Target], update: Update, version: int, infos: Sequence[rollout_pb2.GetInfoResponse]
    ) -> TransferResults:
        tensors = list(update.wire.values())
        timeout_s = self.settings.timeout_s
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
            self._store, self._group = Store(host, self.settings.timeout_s), None
        if self._group is None or members != self._members:
            self._group, self._members, self._group_name = None, members, uuid.uuid4().hex[:12]
        store = self._store
        base = transfer_request(update, version, self.settings.timeout_s)
        base.dist.CopyFrom(rollout_pb2.DistRendezvous(host=host, port=store.port, group=self._group_name,
                                                      world_size=len(targets) + 1, backend=backend,
                                                      bucket_bytes=self.settings.bucket_bytes, chain=chain,
                                                      layout=LAYOUT_VERSION))  # fmt: skip
        # Neighbours in the chain on one host share one copy of the weights: the first receives it, the next maps it.
        # (A chain has one answer per target, in rank order.) shared[i]: rank i + 1 shares with rank i + 2.
        # (A delta is small, and each server decodes it into memory of its own: nothing to share.)
        sharing = chain and self.settings.share_host and not update.base
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
            checked = await gather(targets, lambda a, ch: call_transfer(ch, check, timeout_s))
            refused: TransferResults = {a: o for a, o in checked.items() if isinstance(o, BaseException)}
            if refused:
                return refused
            self._validated = signature
        buckets = layout([t.numel() * t.element_size() for t in tensors], self.settings.bucket_bytes)
        group, world, name = self._group, len(targets) + 1, self._group_name

        def send() -> None:
            pg = group
            if pg is None:
                pg = form_group(host=host, port=store.port, group=name, rank=0, world_size=world, backend=backend,
                                timeout_s=self.settings.timeout_s, store=store.store)  # fmt: skip
            send_buckets(pg, tensors, buckets, self.settings.timeout_s, chain=chain)
            self._group = pg

        self._group = None  # kept again only if this transfer succeeds
        sender = asyncio.ensure_future(asyncio.to_thread(send))
        outcomes = await gather(targets, lambda a, ch: call_transfer(ch, requests[a], timeout_s))
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


# --------------------------------------------------------------------------------------------- the server


class DistReceiver:
    """The server's side: keeps the process groups trainers formed (a few, most recent first), since a trainer
    keeps its group while its servers stay the same and sends only the group's name again."""

    MAX_GROUPS = 4
    source = "dist"
    transport = rollout_pb2.WEIGHT_TRANSPORT_DIST

    def __init__(self) -> None:
        self._groups: collections.OrderedDict[tuple[str, int, str, int, int, str], Any] = collections.OrderedDict()

    def offered(self, recipient: Recipient) -> bool:
        # A backend that says where its weights live (hf); vLLM's engine would need its own weight-transfer engine
        # on both sides (not built yet), so a vLLM server takes shm or grpc.
        return dist_available() and recipient.weights_device is not None

    def check(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], recipient: Recipient
    ) -> None:
        """What the trainer's check round (which names no rank) can already be refused for."""
        rdv = request.dist
        if not dist_available():
            raise InvalidInput("dist: torch.distributed (gloo) is not available on this server")
        if rdv.backend not in ("gloo", "nccl"):
            raise InvalidInput(f"dist.backend: {rdv.backend!r} is not gloo or nccl")

    async def receive(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], timeout_s: float,
        recipient: Recipient,
    ) -> Staged:  # fmt: skip
        """The staged tensors, and what they lie in: buffers of ours (`recipient.staging`), or a host's shared file
        (`recipient.host_file`)."""
        rdv = request.dist
        if not 0 < rdv.rank < rdv.world_size:
            raise InvalidInput(f"dist.rank: {rdv.rank} is not in 1..{rdv.world_size - 1}")
        if rdv.layout != LAYOUT_VERSION:
            raise InvalidInput(
                f"dist.layout: {rdv.layout} is not this server's bucket layout {LAYOUT_VERSION} (a trainer and a "
                "server of different rewardmesh releases); upgrade the older one, or use transport='grpc'"
            )
        if rdv.bucket_bytes < 1:
            raise InvalidInput(f"dist.bucket_bytes must be >= 1, got {rdv.bucket_bytes}")
        if rdv.share_from_prev and not (rdv.chain and rdv.rank >= 2):
            raise InvalidInput("dist.share_from_prev: set only in a chain, on ranks >= 2 (rank 1 hears the trainer)")
        if rdv.share_with_next and not (rdv.chain and rdv.rank + 1 < rdv.world_size):
            raise InvalidInput("dist.share_with_next: set only in a chain on a rank that has a next one")
        model_device = recipient.weights_device or torch.device("cpu")
        device = model_device if rdv.backend == "nccl" else torch.device("cpu")
        key = (rdv.host, rdv.port, rdv.group, rdv.rank, rdv.world_size, rdv.backend)
        buckets = layout([e.wire for e in entries], rdv.bucket_bytes)
        group = self._groups.pop(key, None)  # kept again only if this transfer succeeds
        share = None
        if rdv.chain and device.type == "cpu" and (rdv.share_with_next or rdv.share_from_prev):
            share = HostShare(to_next=rdv.share_with_next, from_prev=rdv.share_from_prev)
        if share is not None and not share.from_prev:  # we receive the host's copy
            share.file = await asyncio.to_thread(recipient.host_file, file_offsets(buckets)[1])
        if share is not None and share.file is not None:
            buffers = share.file.buckets(buckets)
        else:  # (also where a neighbour's file is mapped instead, unless it sends the bytes: no room for a file)
            # (a delta's buckets are small: the spare the model left stays for the delta to start from)
            take = recipient.staging(device, any(e.encoding for e in entries))
            buffers = [take(b.nbytes) for b in buckets]  # spare again only once this update is applied or copied out

        def receive() -> dict[str, torch.Tensor]:
            pg = group
            if pg is None:
                pg = form_group(host=rdv.host, port=rdv.port, group=rdv.group, rank=rdv.rank,
                                world_size=rdv.world_size, backend=rdv.backend, timeout_s=timeout_s)  # fmt: skip
            chain = (rdv.rank, rdv.world_size) if rdv.chain else None
            try:
                staged = receive_buckets(pg, entries, buckets, device, timeout_s, buffers, chain=chain, share=share)
            except ForwardFailed as exc:  # our bytes are whole; the group is not (the next server went away)
                return exc.staged
            self._groups[key] = pg
            while len(self._groups) > self.MAX_GROUPS:
                self._groups.popitem(last=False)
            return staged

        try:
            staged = await asyncio.to_thread(receive)
        except RuntimeError as exc:  # gloo/NCCL: a peer went away or a wait timed out; nothing was applied
            # a late write may still land in these buffers: never reuse them (staging handed them out for good)
            if share is not None and share.file is not None:
                share.file.close()
            text = f"dist: receiving the weights from {rdv.host}:{rdv.port} failed, nothing applied: {exc}"
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(text) from exc
            raise Unavailable(text) from exc
        if share is not None and share.file is not None:
            return Staged(staged, file=share.file)
        return Staged(staged, owned=buffers)
