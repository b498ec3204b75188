"""Compile the fast path's Triton kernels in parallel before the first fused decode needs them.

Triton compiles a kernel variant (one per constexpr set and dtype) the first time it is launched,
~0.2-0.7 s each on an H200 host, and builds a C launcher per kernel signature (~0.35 s, gcc).
An SDXL decode meets ~15 variants: compiled one after another inside the first decode they
cost several seconds. Most of that work (ptxas, gcc, LLVM) runs outside the GIL, so here every
distinct fused module runs its fast path once on a tiny input, in a thread pool, right before
the first fused call of a model's first open-gate decode. Variants depend on channel counts and
dtype only (sizes are never specialized; see the kernels' ``do_not_specialize``), so the real
decode then finds them all compiled.

Warm-up is best effort and has no effect on results: a module that declines the tiny input or
raises is skipped (its kernels then compile on first use, as without warm-up), and no frame
cache or gate state is touched (``prewarm`` calls ``fast_forward`` without a cache).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .log import log_once

MAX_WORKERS = 8
# Only GPUs compile; tests add "cpu" to run the same code under TRITON_INTERPRET.
DEVICE_TYPES = ("cuda",)
_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()


def tiny_input(channels: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A (1, C, 8, 8) channels-last image or (1, C, 1, 8, 8) channels-last-3d video."""
    if rank == 5:
        return torch.randn(1, channels, 1, 8, 8, device=device, dtype=dtype).contiguous(
            memory_format=torch.channels_last_3d)
    return torch.randn(1, channels, 8, 8, device=device, dtype=dtype).contiguous(
        memory_format=torch.channels_last)


def run_fast_once(module, x: torch.Tensor) -> None:
    """``module.fast_forward(x)`` when the module would take ``x``; the output is dropped."""
    if module.fast_unsupported(x) is None:
        module.fast_forward(x)


def _on(device: torch.device):
    """The device as current for launches on this thread (Triton launches on the current one)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def arm(gate, model: torch.nn.Module) -> None:
    """Remember ``model``'s fused modules on its gate; the first fused call warms them up."""
    from .fused import FusedModule

    modules = [m for m in model.modules() if isinstance(m, FusedModule)]
    gate.prewarm_modules = weakref.WeakSet(modules) if modules else None


def _jobs(modules) -> list:
    seen, jobs = set(), []
    for m in list(modules):
        key = m.prewarm_key()
        if key is not None and key not in seen:
            seen.add(key)
            jobs.append(m)
    return jobs


def warm_up(gate, x: object) -> None:
    """Run the armed warm-up once for this gate (called by the first fused forward)."""
    with _LOCK:
        modules, gate.prewarm_modules = gate.prewarm_modules, None
    if modules is None or not isinstance(x, torch.Tensor) or x.device.type not in DEVICE_TYPES:
        return
    device, dtype = x.device, x.dtype
    jobs = _jobs(modules)
    if not jobs:
        return
    start = time.perf_counter()
    failures: list[str] = []

    def one(module) -> None:
        try:
            with torch.inference_mode(), _on(device):
                module.prewarm(device, dtype)
        except Exception as exc:  # best effort: the real call compiles it, or falls back itself
            failures.append(f"{type(module).__name__}: {type(exc).__name__}: {exc}".splitlines()[0])

    # The first job alone: it sets up Triton's per-device state, which threads would race to.
    one(jobs[0])
    workers = min(MAX_WORKERS, os.cpu_count() or 1, len(jobs) - 1)
    if workers > 0:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fvd-prewarm") as pool:
            list(pool.map(one, jobs[1:]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    log_once(f"prewarm:{id(gate)}", f"kernel warm-up: {len(jobs)} modules in {ms:.0f} ms"
             + (f" ({len(failures)} skipped: {failures[0]})" if failures else ""))
    for failure in failures:
        _LOG.debug("warm-up skipped %s", failure)
