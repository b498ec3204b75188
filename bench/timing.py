"""Timing, peak memory and image-difference measurements for the bench and the demo.

On CUDA every call is bracketed by CUDA events (the end event is waited on, so host stalls such
as kernel compilation inside the call are included); on the CPU a monotonic clock is used.
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
