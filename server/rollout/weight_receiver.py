"""Rollout-server side of weight updates: check the manifest, receive on the chosen data plane, then apply.

Nothing reaches the backend until every byte of the update is staged: a transfer that fails or times out
in the middle leaves the old weights serving. The backend applies the staged tensors atomically with respect
to decoding (between micro-batches / engine steps) and sets the new policy version. A backend that can adopt
tensors (hf: `adopt_weights`) takes the staged buffers themselves, an O(1) swap of each parameter's storage
instead of a copy; the buffers it held before are then free and receive the next update (double buffering).

Peak extra memory during an update: the staged weights (dist: the received buckets, which the typed tensors
are views of; grpc: one preallocated tensor per name; shm: nothing, the trainer's file is mapped). On CPU the
dist buffers the model gave back are kept for the next update of the same layout, so the steady state is the
model's weights plus one staged copy, the same as a copy-in backend that keeps its staging buffers. dist servers
of one host that share a copy (common.planes.dist.SharedWeights): the first holds two files (the one the model
serves from, a spare), the others map its file and hold none of their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import torch

from rewardmesh.common.allocator import keep_freed_memory
from rewardmesh.common.errors import DependencyFailed, InvalidInput
from rewardmesh.common.planes import delta as weight_delta
from rewardmesh.common.planes.base import SOURCES, Receiver, Staged, by_source
from rewardmesh.common.planes.cuda_ipc import IpcReceiver
from rewardmesh.common.planes.digests import digest, finite, scan
from rewardmesh.common.planes.dist import DistReceiver, SharedWeights
from rewardmesh.common.planes.grpc_chunks import Message, WeightAssembler, receive_chunks
from rewardmesh.common.planes.layout import byte_view
from rewardmesh.common.planes.manifest import Entry, WeightsError, check_manifest
from rewardmesh.common.planes.shm import ShmReceiver, host_id
from rewardmesh.common.tensors import duration_seconds
from rewardmesh.server.rollout.backends.base import Backend
from rewardmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
MAX_VERSION = (1 << 63) - 1


class StaleBase(DependencyFailed):
    """A delta made against a version this server does not serve (FAILED_PRECONDITION): send the whole weights."""


def next_version(requested: int, current: int) -> int:
    """The version an update sets: above the one in use, within int64 (INVALID_ARGUMENT naming the field)."""
    if requested < 0:
        raise InvalidInput(f"policy_version: {requested} is negative")
    if requested == 0:
        if current >= MAX_VERSION:
            raise InvalidInput(f"policy_version: 0 asks for {current} + 1, past int64; send an explicit version")
        return current + 1
    if requested <= current:
        raise InvalidInput(f"policy_version: {requested} is not above the version in use, {current}")
    return requested


# Buffers of ours that a backend may adopt, as flat uint8 tensors: dist's buckets, or each grpc tensor's bytes.
_Buffers = list[torch.Tensor]
_T = TypeVar("_T")
_CPU = torch.device("cpu")


def _settle(task: asyncio.Future[Any]) -> None:
    """Read a finished task's exception (its caller may have gone): it was reported to the caller, if any."""
    if not task.cancelled():
        task.exception()


def _on_cpu(buffers: _Buffers) -> bool:
    return bool(buffers) and buffers[0].device.type == "cpu"


def _recycler(spare: _Buffers | None, device: torch.device) -> Callable[[int], torch.Tensor]:
    """Staging buffers for the next update: a spare one of exactly the size asked for, whichever data plane
    filled it last (a dist bucket of one large tensor and that tensor over grpc are the same size), else a new
    one. Spares nobody takes are freed with the recycler."""
    free: dict[int, list[torch.Tensor]] = {}
    for b in spare or ():
        if b.device == device:
            free.setdefault(b.numel(), []).append(b)

    def take(nbytes: int) -> torch.Tensor:
        same = free.get(nbytes)
        return same.pop() if same else torch.empty(nbytes, dtype=torch.uint8, device=device)

    return take


class WeightReceiver:
    """One update at a time: the plane named in the request stages it, then it is checked and committed. The
    `Recipient` the planes stage for (common/planes/base.py)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.host_id = host_id()  # who shares this server's /dev/shm
        self.instance_id = uuid.uuid4().hex
        self._lock = asyncio.Lock()
        # CPU staging buffers that nothing uses (the model left them), reused by the next update over dist or grpc
        # wherever the sizes match: it then costs no page faults (what no tensor or bucket of it fits is freed).
        self._spare: _Buffers | None = None
        # The tensors the model left on its last adopted update (views into `_spare`, version `_spare_version`) and
        # what that update changed: a delta update brings them up to date with the changes alone, instead of a copy
        # of the whole model (None: copied from the served tensors).
        self._spare_views: dict[str, torch.Tensor] | None = None
        self._spare_version = -1
        self._spare_changes: dict[str, weight_delta.Change | None] = {}
        # Buffers the backend adopted (the model's weights live in them now): spare after the next adopted update.
        self._held: _Buffers | None = None
        # dist chains sharing one copy per host: the file the model serves from (ours or a neighbour's), and the
        # one of ours it left, written again next time if nobody else serves from it (SharedWeights.reusable).
        self._held_file: tuple[SharedWeights, dict[str, torch.Tensor]] | None = None
        self._spare_file: SharedWeights | None = None
        self._tasks: set[asyncio.Future[Any]] = set()  # commits that run on after their caller left
        # The planes TransferWeights names, fastest first (dist keeps the process groups trainers formed); grpc's
        # chunks come on UpdateWeights (receive_chunks).
        self._planes: dict[str, Receiver] = by_source([IpcReceiver(), ShmReceiver(), DistReceiver()])

    # -- what the planes ask of this server (common.planes.base.Recipient) ----------------------

    @property
    def weights_device(self) -> torch.device | None:
        return self.backend.device

    @property
    def loads_cuda_ipc(self) -> bool:
        return self.backend.loads_cuda_ipc

    def cuda_uuid(self) -> str:
        """The GPU the model runs on ("" if none): a trainer with its tensors there may send CUDA IPC handles."""
        return self.backend.cuda_device_uuid  # vLLM: its engine's, when it takes IPC

    def staging(self, device: torch.device, delta: bool) -> Callable[[int], torch.Tensor]:
        """Where a dist update's buckets go: the spare buffers the model left (a delta's buckets are small: the
        spare stays for the delta to start from), else new ones."""
        return _recycler(None if delta else self._take_spare(), device)

    def host_file(self, size: int) -> SharedWeights | None:
        """The file this server receives a host's shared copy into: its spare one when nobody serves from it."""
        spare, self._spare_file = self._spare_file, None
        if spare is not None and spare.size == size and spare.reusable():
            return spare
        if spare is not None:
            spare.close()  # another server still serves from it (or the layout changed): it keeps its mapping
        try:
            return SharedWeights.create(size)
        except OSError as exc:  # no room under /dev/shm: the bytes go on over TCP
            log.warning("dist: no shared file for the next server on this host, sending it the bytes: %s", exc)
            return None

    # -----------------------------------------------------------------------------------------

    def transports(self) -> list[rollout_pb2.WeightTransport]:
        """What GetInfo offers: every plane this server can receive on, fastest first; grpc always."""
        offered = [p.transport for p in self._planes.values() if p.offered(self)]
        return [*offered, rollout_pb2.WEIGHT_TRANSPORT_GRPC]

    def takes_deltas(self) -> bool:
        """Delta encodings are decoded on the CPU against the tensors the backend serves (hf on a CPU)."""
        return self.backend.takes_deltas and self._device().type == "cpu"

    def _take_spare(self) -> _Buffers | None:
        spare, self._spare, self._spare_views = self._spare, None, None
        return spare

    def _device(self) -> torch.device:
        device = self.backend.device
        return device if device is not None else torch.device("cpu")

    async def _apply(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        owned: _Buffers | None = None,
        file: SharedWeights | None = None,
        *,
        served: dict[str, torch.Tensor] | None = None,
        changes: dict[str, weight_delta.Change | None] | None = None,
    ) -> tuple[int, float]:
        """Hand the staged tensors to the backend. `owned`: they lie in buffers of ours that nothing else will
        write (dist: the buckets, grpc: fresh tensors), so a backend that can adopt them takes them without a copy.
        `file`: they lie in a host's shared file, which the model then serves from (adopted) or is let go (copied).
        """
        started = time.perf_counter()
        private = self._held is not None and self._held_file is None  # the model serves from buffers of ours
        if self._held_file is not None and not ((owned is not None or file is not None) and self._adoptable(tensors)):
            # A copy into the model would write the host's shared file (or fault: a neighbour's is mapped read-only)
            tensors, owned = self._private(tensors, self._held_file[1])
            self._let_go(file)
            file = None
        if owned is not None or file is not None:
            adopted = await self.backend.adopt_weights(tensors, version)
        else:
            await self.backend.update_weights(tensors, version)
            adopted = False
        if adopted:  # whatever the model served from before is free now
            self._let_go(self._held_file[0] if self._held_file else None)
            self._held_file = (file, tensors) if file is not None else None
        else:
            self._let_go(file)
        if owned is not None and _on_cpu(owned):
            if adopted:  # the model left the buffers it held: they receive the next update
                self._spare, self._held = self._held, owned
                if private and served and changes is not None and self._spare is not None:  # what a delta reuses
                    # (they hold version `before`; `changes` bring them to `version`, the one served now)
                    self._spare_views, self._spare_version, self._spare_changes = served, version, changes
            else:  # copied out of them: free again
                self._spare = owned
        elif adopted:  # a shared file, or on a GPU (the caching allocator makes fresh buffers cheap there)
            self._spare, self._held = None, None
        # One spare copy at most: the kind the last update used (a file for a host's shared copy, else buffers).
        if not (adopted and private and served and changes is not None):
            self._spare_views = None
        if self._spare is not None and self._spare_file is not None:
            self._spare_file.close()
            self._spare_file = None
        return self.backend.policy_version, time.perf_counter() - started

    def _adoptable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """The backend would take these tensors themselves rather than copy them in (its own rule)."""
        return self.backend.adoptable(tensors)

    def _private(
        self, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], _Buffers]:
        """The whole model in buffers of this process: the update where it has a tensor, else the weights held now.
        One copy, as a copy into the model would be; the model adopts them and leaves the shared file."""
        take = _recycler(self._take_spare(), torch.device("cpu"))
        out = {}
        for name, (shape, dtype) in self.backend.weight_specs().items():
            buf = take(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
            buf.copy_(tensors.get(name, held[name]))
            out[name] = buf
        return out, [byte_view(t) for t in out.values()]

    def _let_go(self, file: SharedWeights | None) -> None:
        """Serve from `file` no longer; one of ours is kept to be written again."""
        if file is None:
            return
        if file.owner and self._spare_file is None:
            self._spare_file = file
        else:
            file.close()

    async def receive_chunks(
        self, requests: AsyncIterator[rollout_pb2.UpdateWeightsRequest]
    ) -> rollout_pb2.UpdateWeightsResponse:
        """The UpdateWeights stream: chunks into preallocated tensors, every chunk checked as it arrives; applied
        only once the stream ended whole and every tensor checks out, and then whatever the client does."""
        keep_freed_memory()  # gRPC's receive buffers, a message's worth each, recycled rather than faulted in
        version = base = 0

        def begin(first: Message) -> WeightAssembler:
            """The first message's manifest and version checked: the assembler its chunks go into."""
            nonlocal version, base
            version = next_version(first.policy_version, self.backend.policy_version)
            base = first.delta_base_version
            entries = check_manifest(first.manifest, self.backend.weight_specs())
            self._check_base(entries, base)
            # a delta starts from the served tensors: the spare stays for it (its own buffers are small)
            take = None if any(e.encoding for e in entries) else _recycler(self._take_spare(), _CPU)
            assembler = WeightAssembler(self.backend.weight_specs(), take)
            assembler.expect(first.manifest)
            return assembler

        assembler = await receive_chunks(requests, begin)
        staged = assembler.staged()
        tensors, owned = staged.tensors, staged.owned
        expected = assembler.expected or []

        async def commit() -> tuple[int, float]:
            async with self._lock:
                return await self._commit(tensors, expected, version, base, owned)

        applied, spent = await self._shielded(commit())
        log.info("applied %d tensors (%d bytes) from grpc as policy version %d in %.3fs",
                 len(tensors), assembler.num_bytes, applied, spent)  # fmt: skip
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=applied, num_tensors=len(tensors), num_bytes=assembler.num_bytes, apply_seconds=spent
        )

    async def _shielded(self, work: Coroutine[Any, Any, _T]) -> _T:
        """Run `work` to its end whatever happens to the call awaiting it: a client that cancels (or dies) once its
        update is complete can neither apply half of it nor interrupt the backend in the middle of the swap."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(_settle)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    def _check_base(self, entries: list[Entry], base: int) -> None:
        """A delta update must be made against exactly what this server serves (StaleBase otherwise)."""
        encoded = [e for e in entries if e.encoding]
        if not encoded:
            return
        if not self.takes_deltas():
            raise InvalidInput(f"tensors: {encoded[0].name!r} is a delta, and this server takes none (GetInfo)")
        if base != self.backend.policy_version:
            raise StaleBase(f"delta_base_version: {base} is not the version this server serves, "
                            f"{self.backend.policy_version}: send the whole weights")  # fmt: skip
        served = self.backend.served_weights()
        for e in encoded:
            t = served.get(e.name)
            if t is None or t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise StaleBase(f"tensor {e.name!r}: a delta against a {e.dtype} tensor, this server serves "
                                f"{None if t is None else t.dtype}: send the whole weights")  # fmt: skip

    async def _commit(
        self,
        tensors: dict[str, torch.Tensor],
        entries: list[Entry],
        version: int,
        base: int,
        owned: _Buffers | None = None,
        file: SharedWeights | None = None,
    ) -> tuple[int, float]:
        """Decode deltas, check every tensor (digest, finite), then apply; nothing is applied when one fails.
        Called with the lock held."""
        version = next_version(version, self.backend.policy_version)  # (again: another update may have landed)
        self._check_base(entries, base)
        served = self.backend.served_weights() if self.takes_deltas() else {}
        try:
            tensors, extra, changes = await asyncio.to_thread(self._decode_and_check, tensors, entries, served)
        except BaseException:
            self._let_go(file)
            raise
        if owned is not None and extra:
            owned = [*owned, *extra]
        return await self._apply(tensors, version, owned, file, served=served, changes=changes)

    def _decode_and_check(
        self, tensors: dict[str, torch.Tensor], entries: list[Entry], served: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], _Buffers, dict[str, weight_delta.Change | None]]:
        """The tensors the model will serve: deltas applied to a private copy of the served ones (the spare the
        model left, brought up to date, where there is one); then each tensor's digest and finiteness."""
        changes: dict[str, weight_delta.Change | None] = {e.name: None for e in entries}
        extra: _Buffers = []
        encoded = [e for e in entries if e.encoding]
        if encoded:
            work = self._caught_up_spare(served)
            if work is not None:
                extra = self._take_spare() or []
            else:
                take = _recycler(self._take_spare(), _CPU)
            out = dict(tensors)
            for e in encoded:
                base_bits = weight_delta.bits(served[e.name])
                change = weight_delta.decode(e, tensors[e.name], base_bits)
                if work is not None:
                    target = work[e.name]
                else:
                    target = take(e.nbytes).view(e.dtype).view(e.shape)
                    target.copy_(served[e.name])
                    extra.append(byte_view(target))
                weight_delta.apply(weight_delta.bits(target), change)
                out[e.name], changes[e.name] = target, change
            tensors = out
        for e in entries:
            t, made = tensors[e.name], changes[e.name]
            if made is None:  # the whole tensor: digest and finiteness in one pass
                got, ok = scan(t) if e.digest is not None else (None, finite(t))
            else:  # a delta: the result's digest; only the new values can be new NaNs
                got = digest(t) if e.digest is not None else None
                ok = finite(torch.from_numpy(made.values).view(e.dtype))
            if e.digest is not None and got != e.digest:
                raise WeightsError(f"tensor {e.name!r}: digest mismatch, the bytes received are not the bytes sent; "
                                   "nothing applied")  # fmt: skip
            if not ok:
                raise WeightsError(f"tensor {e.name!r}: holds NaN or infinity; nothing applied")
        return tensors, extra, changes

    def _caught_up_spare(self, served: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The tensors the model left on its last adopted update, brought to the version it serves now with what
        that update changed (no copy of the whole model), or None when there are none to use."""
        views = self._spare_views
        if views is None or self._spare_version != self.backend.policy_version or views.keys() != served.keys():
            return None
        for name, t in views.items():
            change = self._spare_changes.get(name)
            if change is None:
                t.copy_(served[name])
            else:
                weight_delta.apply(weight_delta.bits(t), change)
        return views

    async def transfer(self, request: rollout_pb2.TransferWeightsRequest) -> rollout_pb2.TransferWeightsResponse:
        """TransferWeights: validate the manifest first (INVALID_ARGUMENT naming the tensor), then receive, apply."""
        started = time.perf_counter()
        entries = check_manifest(request.tensors, self.backend.weight_specs(), request.total_bytes)
        plane = self._planes.get(request.WhichOneof("source") or "")
        if plane is None:
            *most, last = [name for name in SOURCES if name in self._planes]
            raise InvalidInput(f"source: set {', '.join(most)} or {last} (gRPC chunks go on UpdateWeights)")
        plane.check(request, entries, self)
        next_version(request.policy_version, self.backend.policy_version)
        self._check_base(entries, request.delta_base_version)
        if request.validate_only:
            return rollout_pb2.TransferWeightsResponse(policy_version=self.backend.policy_version)
        applied, spent = await self._shielded(self._transfer(request, entries, plane))
        total = sum(e.wire for e in entries)
        seconds = time.perf_counter() - started
        log.info("applied %d tensors (%d bytes) from %s as policy version %d in %.3fs (apply %.3fs)",
                 len(entries), total, plane.source, applied, seconds, spent)  # fmt: skip
        return rollout_pb2.TransferWeightsResponse(
            policy_version=applied, num_tensors=len(entries), num_bytes=total, seconds=seconds, apply_seconds=spent
        )

    async def _transfer(
        self, request: rollout_pb2.TransferWeightsRequest, entries: list[Entry], plane: Receiver
    ) -> tuple[int, float]:
        timeout_s = duration_seconds(request.timeout) if request.HasField("timeout") else DEFAULT_TIMEOUT_S
        version, base = request.policy_version, request.delta_base_version
        async with self._lock:
            staged = await plane.receive(request, entries, timeout_s, self)
            if staged.handles is not None:
                return await self._load_handles(staged, entries, version)
            return await self._commit(staged.tensors, entries, version, base, staged.owned, staged.file)

    async def _load_handles(self, staged: Staged, entries: list[Entry], version: int) -> tuple[int, float]:
        """The trainer's CUDA tensors, loaded by an engine that opens their handles itself (vLLM's weight-transfer
        engine; the plane checked the digests over what the handles open)."""
        assert staged.handles is not None
        started = time.perf_counter()
        version = next_version(version, self.backend.policy_version)
        await self.backend.update_weights_ipc(entries, staged.handles, version)
        return self.backend.policy_version, time.perf_counter() - started
