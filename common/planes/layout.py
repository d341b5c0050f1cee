"""Byte layouts of a weight update: computed from the manifest alone, so sender and receiver agree on them
without sending them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rewardmesh.common.planes.manifest import Entry

ALIGN = 64  # every tensor starts at a multiple of this in a bucket or a shared-memory file
DEFAULT_BUCKET_BYTES = 256 << 20
ALONE_BYTES = 1 << 20  # see `layout`
LAYOUT_VERSION = 2  # what `layout` computes; on the wire as DistRendezvous.layout / GetInfoResponse.dist_layout


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Bucket:
    """Tensors `members` (indices into the manifest), at `offsets` inside one buffer of `nbytes`."""

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


def layout(sizes: Sequence[int], bucket_bytes: int, alone_bytes: int = ALONE_BYTES) -> list[Bucket]:
    """The buckets of an update, one collective call each: a tensor of alone_bytes or more (or larger than a
    bucket) is a bucket of its own, sent from where it lies without a packing copy; every smaller tensor,
    wherever it lies in the manifest, is packed with the others into buckets of at most bucket_bytes, which
    come first (a model's many small norms and biases lie between its large matrices: packed in manifest
    order they would cost a call each)."""
    packed: list[Bucket] = []
    members: list[int] = []
    offsets: list[int] = []
    end = 0
    alone = []
    for i, size in enumerate(sizes):
        if size >= min(alone_bytes, bucket_bytes + 1):
            alone.append(Bucket((i,), (0,), size))
            continue
        start = aligned(end)
        if members and start + size > bucket_bytes:
            packed.append(Bucket(tuple(members), tuple(offsets), end))
            members, offsets, start = [], [], 0
        members.append(i)
        offsets.append(start)
        end = start + size
    if members:
        packed.append(Bucket(tuple(members), tuple(offsets), end))
    return packed + alone


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (no copy for a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def views(buffer: torch.Tensor, entries: Sequence[Entry], offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """Typed tensors lying inside a flat uint8 buffer at the given offsets (no copy)."""
    return {
        e.name: buffer[off : off + e.wire] if e.encoding else buffer[off : off + e.nbytes].view(e.dtype).view(e.shape)
        for e, off in zip(entries, offsets, strict=True)
    }
