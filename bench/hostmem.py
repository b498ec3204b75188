"""Host (CPU) allocator conditions for timing: glibc's trim and mmap thresholds.

ComfyUI's ``VAE.decode`` finishes on the CPU (copy to the output device, ``float()``,
``process_output``, the output tensor): ~50 MB of short-lived CPU tensors per 1024² image. In a
fresh process glibc hands that memory back to the OS after every call, so every decode
page-faults it in again: measured on the H200 host, 12,256 minor faults and ~6-10 ms per decode
for the first case of a run, 0 faults once the heap is fragmented (any later case, or a
long-running ComfyUI server). The cost is the same for stock and fast decodes, but it is not the
decoder's and it depends on what ran before, which made the first case of a run look slower.

``steady`` raises the trim threshold (freed memory is kept for reuse) and the mmap threshold to
glibc's maximum (32 MiB on 64-bit), so images measure the steady state. Video outputs (>32 MiB)
are still mapped fresh per call, as in any glibc process. ``system`` leaves malloc alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1 << 30


def keep_freed_host_memory() -> str:
    """Apply ``steady``; returns what was done (recorded in the bench environment)."""
    if not sys.platform.startswith("linux"):
        return f"system (no glibc on {sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"system (no mallopt: {exc})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and ok
    return (f"steady (glibc trim threshold {TRIM_THRESHOLD >> 20} MiB, mmap threshold "
            f"{MMAP_THRESHOLD_MAX >> 20} MiB)" if ok else "system (mallopt refused)")
