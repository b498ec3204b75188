"""Compile the fast path's Triton kernels in parallel before the first fused decode needs them.

Triton compiles a kernel variant (one per constexpr set and dtype) the first time it is launched,
~0.2-0.7 s each on an H200 host, and builds a C launcher per kernel signature (~0.35 s, gcc).
An SDXL decode meets ~15 variants: compiled one after another inside the first decode they
cost several seconds (8 s measured). Right before the first fused call of a model's first
open-gate decode, every distinct fused module runs its fast path once on a tiny input with
Triton launches *recorded* instead of run (``kernels.backend.recording_launches``); each
distinct variant is compiled once, in a thread pool that takes it as soon as its module has
recorded it (ptxas, gcc and LLVM run outside the GIL, while later modules record). Variants
depend on channel counts, dtype and some operand flags (sizes are never specialized; see the
kernels' ``do_not_specialize`` and ``variant_key``), and on the calls a module makes: a module
whose calls differ with state or size warms up the way a decode calls it (a Wan residual block
through a private frame cache; the Wan attention, whose row softmax tiles a whole frame, on the
latent's frame size, ``frame_hint``). So the real decode finds them all compiled.

Warm-up is best effort and has no effect on results: a module that declines its warm-up input
or raises, or a variant that fails to compile, is skipped (it then compiles on first use, as
without warm-up), and no frame cache or gate state of the model is touched (a module's
``prewarm`` passes no cache, or a private one).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..kernels.backend import (
    compile_launch,
    on_device,
    recording_launches,
    start_compiler_key,
    triton,
    variant_key,
    wait_compiler_key,
)
from ..kernels.padded_grid_conv import prepare_in_background
from .log import say

# Compile threads (bounded by the host's CPUs). SDXL's 22 variants, fresh Triton cache, H200 host
# with 16 CPUs, ComfyUI 0.33 (0985964): 8.3 s with 1 thread, 2.97 / 3.45 s with 8, 2.88 / 2.85 s
# with 16 -- the front end holds the GIL, ptxas and the launchers' gcc do not. (Since then a
# norm without an input bias shares the biased variants: SDXL has 16.)
MAX_WORKERS = 16
# Only GPUs compile; tests add "cpu" to run the same code under TRITON_INTERPRET.
DEVICE_TYPES = ("cuda",)
_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()


def start_triton_setup(device: torch.device) -> bool:
    """At start-up, for the device ComfyUI will decode on: set Triton's driver up and hash its
    compiler's key on a thread of their own, so the first fast decode (usually long after
    start-up) waits on neither. In a fresh process with an empty Triton cache they take
    0.3-0.9 s; started at install, as the first decode began, they held Wan 2.2's first decode
    up by 0.82 s (H200, 0.33). Only a CUDA device with Triton; True if started."""
    if device.type != "cuda" or triton is None or not torch.cuda.is_available():
        return False
    start_compiler_key()
    from .families.kl.settings import settings as kl_settings
    from .families.wan.settings import settings as wan_settings

    # The optional Hopper conv: its import and compiles, for the routes that are on (both
    # wings' convs are bias-free; Wan's second convs may take the residual epilogue).
    taps = (((1,) if kl_settings.padded_grid_conv else ())
            + ((3,) if wan_settings.padded_grid_conv else ()))
    if taps:
        variants = ((False, False), (True, True)) if wan_settings.padded_grid_residual else \
            ((False, False),)
        prepare_in_background(device, variants, taps, ffi=wan_settings.padded_grid_tvm_ffi)
    return True


def tiny_input(channels: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A (1, C, 8, 8) channels-last image or (1, C, 1, 8, 8) channels-last-3d video."""
    if rank == 5:
        return torch.randn(1, channels, 1, 8, 8, device=device, dtype=dtype).contiguous(
            memory_format=torch.channels_last_3d)
    return torch.randn(1, channels, 8, 8, device=device, dtype=dtype).contiguous(
        memory_format=torch.channels_last)


def _jobs(modules) -> list:
    """One module per distinct ``prewarm_key``, those that ``prewarm_first`` first: compiles
    start in recording order, so the longest must not be recorded late. Recorded last, Wan
    2.2's head conv handed its 1.39 s implicit-GEMM compile to the pool at 1.38 s and the
    warm-up ended at 2.86 s; recorded first, 1.36-1.79 s (H200, 0.33, 16 threads)."""
    seen, jobs = set(), []
    for m in list(modules):
        key = m.prewarm_key()
        if key is not None and key not in seen:
            seen.add(key)
            jobs.append(m)
    return sorted(jobs, key=lambda m: not m.prewarm_first())  # stable: the rest keep their order


_FRAME = threading.local()


def frame_hint() -> tuple[int, int] | None:
    """During a warm-up: the (height, width) of the first fused call's input, the latent frame
    a decoder's mid-block will see; None outside one. For kernels whose variant depends on a
    size class (the Wan attention's row softmax tiles a whole frame's tokens)."""
    return getattr(_FRAME, "size", None)


def warm_up(gate, x: object) -> None:
    """Run the armed warm-up once for this gate (called by the first fused forward)."""
    with _LOCK:
        modules, gate.prewarm_modules = gate.prewarm_modules, None
    if (modules is None or triton is None or not isinstance(x, torch.Tensor)
            or x.device.type not in DEVICE_TYPES):
        return
    device, dtype = x.device, x.dtype
    jobs = _jobs(modules)
    if not jobs:
        return
    start_compiler_key()  # (if install did not) set up while the first modules record
    start = time.perf_counter()
    failures: list[str] = []

    def compile_one(record) -> None:
        wait_compiler_key()  # driver set up and key hashed once, not by racing workers
        try:
            with on_device(device):
                compile_launch(record)
        except Exception as exc:
            failures.append(f"{record[0]}: {type(exc).__name__}: {exc}".splitlines()[0])

    # Each distinct module runs its fast path on a tiny input with Triton launches recorded,
    # not run (torch ops still run; outputs are garbage, dropped). A variant is handed to the
    # compile pool as soon as a module has recorded it, so ptxas, gcc and LLVM (outside the
    # GIL) work while later modules record.
    variants: dict = {}
    workers = min(MAX_WORKERS, os.cpu_count() or 1)
    pool = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fvd-prewarm")
            if workers > 1 else None)
    _FRAME.size = tuple(x.shape[-2:]) if x.dim() >= 4 else None
    try:
        with recording_launches() as recorded, torch.inference_mode():
            for module in jobs:
                seen = len(recorded)
                try:
                    module.prewarm(device, dtype)
                except Exception as exc:  # best effort: the real call compiles it, or falls back
                    failures.append(
                        f"{type(module).__name__}: {type(exc).__name__}: {exc}".splitlines()[0])
                for record in recorded[seen:]:
                    key = variant_key(record)
                    if key not in variants:
                        variants[key] = record
                        if pool is not None:
                            pool.submit(compile_one, record)
    finally:
        _FRAME.size = None
        if pool is not None:
            pool.shutdown(wait=True)
    if pool is None:
        for record in variants.values():
            compile_one(record)
    wait_compiler_key()  # (with no variant to compile) the decode's launches find it set up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    # Unkeyed: a gate is armed once (at install) and disarmed above, so this runs once per gate;
    # an id() key would silence a later gate at a freed one's address.
    say(f"kernel warm-up: {len(variants)} kernel variants of {len(jobs)} modules in {ms:.0f} ms"
        + (f" ({len(failures)} skipped: {failures[0]})" if failures else ""))
    for failure in failures:
        _LOG.debug("warm-up skipped %s", failure)
