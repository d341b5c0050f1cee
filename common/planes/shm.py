"""The shm plane: one file under /dev/shm, written once by the trainer (`ShmSender`, `ShmWriter`), mapped by
every rollout server on the host (`ShmReceiver`)."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import mmap
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
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
from rewardmesh.common.planes.layout import byte_view, layout, views
from rewardmesh.common.planes.manifest import Entry
from rewardmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def host_id() -> str:
    """Who shares this process's /dev/shm: the kernel's boot id plus the mount's device and inode.

    Two containers of one pod share it; two pods on one node (each with its own /dev/shm) do not.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = SHM_DIR.stat()
    except OSError:
        return ""
    if not os.access(SHM_DIR, os.W_OK | os.R_OK):
        return ""
    return hashlib.sha1(f"{boot}:{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:16]


SHM_PREFIX = "rewardmesh-weights-"


def sweep_stale_shm() -> list[Path]:
    """Remove the weight files of trainers that are gone (crashed, killed): a live writer holds an exclusive
    flock on its file for as long as it exists, so a file whose lock can be taken has no owner. Safe across
    processes and containers sharing /dev/shm (one kernel); returns what was removed."""
    removed = []
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its writer is alive
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d weight file(s) under %s left by trainers that are gone", len(removed), SHM_DIR)
    return removed


def _release(fd: int, path: Path) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)  # drops the lock


class ShmWriter:
    """The trainer's file under /dev/shm, reused while the layout's size stays the same.

    The file is removed by `close`, at interpreter exit, or, when this process dies without either (killed),
    by the next ShmWriter on the host (`sweep_stale_shm`): the writer holds a flock on it while it lives.
    It stays mapped between writes: a new mapping would fault every page in again on each update (52k faults,
    about as long as the copy itself, for the 212 MB benchmark model)."""

    def __init__(self) -> None:
        sweep_stale_shm()
        self.path = SHM_DIR / f"{SHM_PREFIX}none"
        self._fd = -1
        self._size = -1
        self._mapped: torch.Tensor | None = None  # the file's bytes, mapped once per file
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _create(self, size: int) -> None:
        name = f"{SHM_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        staging = SHM_DIR / f".{name}"  # locked before it gets a name the sweeper looks at
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, max(size, 1))
            os.rename(staging, SHM_DIR / name)
        except BaseException:
            staging.unlink(missing_ok=True)
            os.close(fd)
            raise
        self.path, self._fd, self._size = SHM_DIR / name, fd, size
        self._finalizer = weakref.finalize(self, _release, fd, self.path)

    def rotate(self) -> None:
        """Write the next update to a new file: a straggler may still be reading this one (unlinked, it stays
        readable by whoever has it mapped, and is freed when they let go)."""
        self.close()

    def write(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], size: int) -> None:
        if self._fd >= 0 and self._size != size:
            self.rotate()  # never truncate a file someone may have mapped
        if self._fd < 0:
            self._create(size)
        if self._mapped is None:
            self._mapped = torch.frombuffer(mmap.mmap(self._fd, max(size, 1)), dtype=torch.uint8)
        for t, off in zip(tensors, offsets, strict=True):
            src = byte_view(t)
            self._mapped[off : off + src.numel()].copy_(src)

    def close(self) -> None:
        self._mapped = None  # unmapped when the last view of it goes
        if self._finalizer is not None:
            self._finalizer()  # unlink and unlock, once
            self._finalizer = None
        self._fd, self._size = -1, -1


def weights_file(path: str, field: str) -> Path:
    resolved = Path(path).resolve()
    if resolved.parent != SHM_DIR or not resolved.name.startswith(SHM_PREFIX):
        raise InvalidInput(f"{field}: {path!r} is not a rewardmesh weights file under {SHM_DIR}")
    return resolved


def map_shm(path: str, entries: Sequence[Entry], offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """Typed views of a trainer's shared-memory file (copy-on-write mapping: reading copies nothing)."""
    resolved = weights_file(path, "shm.path")
    if len(offsets) != len(entries):
        raise InvalidInput(f"shm.offsets: {len(offsets)} offsets for {len(entries)} tensors")
    end = max((off + e.wire for e, off in zip(entries, offsets, strict=True)), default=0)
    for e, off in zip(entries, offsets, strict=True):
        if off < 0 or off % (1 if e.encoding else e.dtype.itemsize):
            raise InvalidInput(f"shm.offsets: offset {off} of tensor {e.name!r} is negative or misaligned")
    with open(resolved, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < end:
            raise InvalidInput(f"shm.path: {path!r} has {size} bytes, the manifest needs {end}")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return views(torch.frombuffer(mm, dtype=torch.uint8), entries, offsets)


class ShmReceiver:
    """The server's side: the trainer's file, mapped (never adopted: the trainer writes it again next time)."""

    source = "shm"
    transport = rollout_pb2.WEIGHT_TRANSPORT_SHM

    def offered(self, recipient: Recipient) -> bool:
        return bool(recipient.host_id)

    def check(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], recipient: Recipient
    ) -> None:
        if not recipient.host_id:
            raise InvalidInput("shm: this server has no usable /dev/shm")

    async def receive(
        self, request: rollout_pb2.TransferWeightsRequest, entries: Sequence[Entry], timeout_s: float,
        recipient: Recipient,
    ) -> Staged:  # fmt: skip
        shm = request.shm
        return Staged(await asyncio.to_thread(map_shm, shm.path, entries, list(shm.offsets)))


class ShmSender:
    """The trainer's side: the update written once into its file, whose path every server is sent."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._shm: ShmWriter | None = None

    async def send(
        self, targets: Sequence[Target], update: Update, version: int, infos: Sequence[rollout_pb2.GetInfoResponse]
    ) -> TransferResults:
        tensors = list(update.wire.values())
        (bucket,) = layout([t.numel() * t.element_size() for t in tensors], bucket_bytes=1 << 62, alone_bytes=1 << 62)
        if self._shm is None:
            self._shm = ShmWriter()
        shm = self._shm
        await asyncio.to_thread(shm.write, tensors, bucket.offsets, bucket.nbytes)
        request = transfer_request(update, version, self.settings.timeout_s)
        request.shm.path = str(shm.path)
        request.shm.offsets.extend(bucket.offsets)
        outcomes = await gather(targets, lambda a, ch: call_transfer(ch, request, self.settings.timeout_s))
        if any(isinstance(o, BaseException) for o in outcomes.values()):
            shm.rotate()  # a server that gave up late may still read the old file
        return outcomes

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
