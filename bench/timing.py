"""Timing, peak memory and image-difference measurements for the bench and the demo.

On CUDA every decode is bracketed by CUDA events (the end event is waited on, so host stalls such
as kernel compilation inside the call are included: the user waits for them too); on the CPU a
monotonic clock is used. Single ops (the per-conv and cuDNN-graph benches) are timed as queued
calls instead (``queued_ms``), so their GPU time is not hidden under the host's launch time.
Peak memory is the CUDA allocator's peak during the timed calls minus what was allocated
before them, i.e. what the decode itself added on top of the weights and inputs.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def timed_call(fn: Callable[[], Any], device: torch.device | str) -> tuple[float, Any]:
    """(milliseconds, result) of one call of ``fn``."""
    if is_cuda(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result
    start_s = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start_s) * 1e3, result


@dataclass
class Measurement:
    """Timed calls of one path: every time, their median, the peak extra memory, the output."""

    times_ms: list[float] = field(default_factory=list)
    peak_extra_bytes: int | None = None
    output: Any = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan


def measure(fn: Callable[[], Any], device: torch.device | str, repeats: int,
            warmup: int = 1) -> Measurement:
    """``warmup`` untimed calls, then ``repeats`` timed ones; keeps the last output.

    The previous output is released before each call so it never counts in the next call's
    peak memory.
    """
    for _ in range(warmup):
        fn()
    cuda = is_cuda(device)
    if cuda:
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    result = Measurement()
    for _ in range(max(1, repeats)):
        result.output = None
        ms, result.output = timed_call(fn, device)
        result.times_ms.append(ms)
    if cuda:
        result.peak_extra_bytes = torch.cuda.max_memory_allocated(device) - base
    return result


# 7e6 cycles is about 4 ms at Hopper's clocks: long enough for the host to queue ``calls``
# launches of a few tens of µs each behind it, so the timed calls run back to back on the GPU.
_QUEUE_SLEEP_CYCLES = 7_000_000
_QUEUE_MAX_CALLS = 20
_QUEUE_SPAN_MS = 2.0


def queued_ms(fn: Callable[[], Any], device: torch.device | str, repeats: int,
              warmup: int = 1, calls: int | None = None) -> list[float]:
    """Per-call milliseconds of ``calls`` back-to-back calls of ``fn``, ``repeats`` times.

    For one op of a few tens of µs, one call between two CUDA events measures the host's
    launch time, not the GPU's (s44: a 7 µs norm timed at 0.14 ms). Here the calls are
    queued behind a GPU sleep between one pair of events and the span is divided by their
    number. Repeated calls read an input the previous call left in L2, which a decode's op
    would not; for inputs past L2's size (most decoder convs) that makes no difference.
    ``calls`` left None: as many as fill about ``_QUEUE_SPAN_MS`` by the last warm-up call's
    one-call time (at most ``_QUEUE_MAX_CALLS``), so an op of milliseconds is not run 20 times
    over. On the CPU the calls are timed with a monotonic clock, one span per repeat.
    """
    single_ms = math.inf
    for _ in range(warmup if calls is not None else max(1, warmup)):
        single_ms, _ = timed_call(fn, device)
    if calls is None:
        calls = min(_QUEUE_MAX_CALLS, math.ceil(_QUEUE_SPAN_MS / max(single_ms, 1e-3)))
    calls = max(1, calls)
    cuda = is_cuda(device)
    times = []
    for _ in range(max(1, repeats)):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            torch.cuda._sleep(_QUEUE_SLEEP_CYCLES)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            start_s = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start_s) * 1e3 / calls)
    return times


def to_unit_range(images: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 CPU images in [0, 1]; ``signed`` outputs (diffusers, [-1, 1]) are mapped first."""
    images = images.detach().float().cpu()
    if signed:
        images = (images + 1.0) / 2.0
    return images.clamp(0.0, 1.0)


def psnr_db(test: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of ``test`` against ``reference``, both in [0, 1]; inf when identical."""
    if test.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(test.shape)} vs {tuple(reference.shape)}")
    mse = torch.mean((test.double() - reference.double()) ** 2).item()
    if mse == 0.0:
        return math.inf
    if not math.isfinite(mse):
        return math.nan
    return 10.0 * math.log10(1.0 / mse)


def all_finite(images: torch.Tensor) -> bool:
    return bool(torch.isfinite(images).all().item())
