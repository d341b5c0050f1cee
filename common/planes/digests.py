"""Digests and finiteness: what a server checks over the tensors it is about to serve, whatever plane
brought them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xxhash

from rewardmesh.common.planes.layout import byte_view
from rewardmesh.common.planes.manifest import Entry, WeightsError


def digest(t: torch.Tensor) -> int:
    """xxh3-64 of a tensor's bytes (a CUDA tensor's are copied to the host first)."""
    raw = byte_view(t.cpu() if t.is_cuda else t)
    return int(xxhash.xxh3_64_intdigest(memoryview(raw.numpy())))  # type: ignore[arg-type]


_ABS_MASK = {2: 0x7FFF, 4: 0x7FFFFFFF}
_EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
_SCAN = 1 << 16  # elements per pass of `finite`: a pass stays in the CPU's cache


def scan(t: torch.Tensor) -> tuple[int, bool]:
    """`digest(t)` and `finite(t)` in one pass: each piece is hashed and checked while it is in the CPU's cache."""
    if t.is_cuda:
        return digest(t), finite(t)
    bits = byte_view(t).numpy().view(np.uint16 if t.element_size() == 2 else np.uint32)
    mask, limit = _ABS_MASK[t.element_size()], _EXPONENT[t.dtype]
    hasher = xxhash.xxh3_64()
    scratch = np.empty(min(_SCAN, bits.size), bits.dtype)
    ok = True
    for start in range(0, bits.size, _SCAN):
        piece = bits[start : start + _SCAN]
        hasher.update(memoryview(piece))  # type: ignore[arg-type]
        if ok:
            out = scratch[: piece.size]
            np.bitwise_and(piece, mask, out=out)
            ok = int(out.max()) < limit
    return int(hasher.intdigest()), ok


def finite(t: torch.Tensor) -> bool:
    """No NaN or infinity: no element has every exponent bit set. A pass per cache-sized piece over the bits
    (torch.isfinite on bf16 reads 200 MB in 1.7 s on the benchmark machine; this in ~15 ms)."""
    if t.is_cuda:
        return bool(torch.isfinite(t).all())
    bits = byte_view(t).numpy().view(np.uint16 if t.element_size() == 2 else np.uint32)
    mask, limit = _ABS_MASK[t.element_size()], _EXPONENT[t.dtype]
    scratch = np.empty(min(_SCAN, bits.size), bits.dtype)
    for start in range(0, bits.size, _SCAN):
        piece = bits[start : start + _SCAN]
        out = scratch[: piece.size]
        np.bitwise_and(piece, mask, out=out)
        if int(out.max()) >= limit:
            return False
    return True


def check_received(tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry]) -> None:
    """What a server checks over the tensors it is about to serve, before anything is applied: each one's digest
    (when the trainer sent one) and that it holds no NaN or infinity. WeightsError names the tensor."""
    for e in entries:
        t = tensors[e.name]
        got, ok = scan(t) if e.digest is not None else (None, finite(t))
        if e.digest is not None and got != e.digest:
            raise WeightsError(f"tensor {e.name!r}: digest mismatch: the bytes received are not the bytes sent")
        if not ok:
            raise WeightsError(f"tensor {e.name!r}: holds NaN or infinity")
