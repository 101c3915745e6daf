"""The process's allocator, set once at start-up for messages of hundreds of KiB (glibc only).

Every hop allocates a few buffers the size of its micro-batch (512 KiB for 32 rows of a 70B model's hidden
states in bf16): gRPC's receive buffer, the parsed message, the bytes of its tensor. glibc serves any
allocation above its mmap threshold (128 KiB, raised only after a free) with a fresh mmap, so each buffer
pays a page fault per 4 KiB it touches and a munmap when freed: measured with `specpipe bench-hop` (2-core
machine), that took a 512 KiB hop from 0.42 ms to 1.15 ms at the median. `tune_allocator` keeps such buffers
on the heap and the heap's free memory in the process, so they are reused; allocations above `mmap_bytes`
(32 MiB, glibc's documented maximum on 64-bit: weights, K/V caches) are mapped as before.

    >>> tune_allocator()      # on glibc (Linux); False where the C library is another
    True
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_tuned = False


def tune_allocator(mmap_bytes: int = 32 * 1024 * 1024) -> bool:
    """Serve allocations up to `mmap_bytes` from the heap and keep up to twice that of freed heap memory.

    Returns whether glibc accepted both settings (False elsewhere: musl, macOS). Idempotent.
    """
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * mmap_bytes))
    return _tuned
