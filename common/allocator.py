"""glibc's allocator, tuned for processes that churn through large message buffers (the grpc weight plane)."""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's own upper bound for its adaptive threshold (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20
_malloc_kept: bool | None = None


def keep_freed_memory() -> bool:
    """glibc: recycle freed buffers of up to 32 MiB inside the process instead of handing them back to the kernel.

    The grpc data plane allocates and frees every message's bytes several times on each side (ours, gRPC's
    copies). glibc's defaults map a large buffer fresh and unmap it when freed, or trim the heap once 2x its
    adaptive threshold lies free at the top, so the next message faults every page in again (zeroed by the
    kernel): measured on the 212 MB benchmark model, ~50k page faults per update and per process, up to half the
    trainer's CPU for the update. Fixed thresholds (mmap above 32 MiB, trim beyond 256 MiB free) keep those pages.
    Process-wide and once; called where a grpc update is sent or received. False where there is no glibc."""
    global _malloc_kept
    if _malloc_kept is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc (macOS): nothing to set
            _malloc_kept = False
        else:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _malloc_kept = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD) == 1  # fmt: skip
    return _malloc_kept
