"""Switches of the KL image-VAE fast path that are chosen by measurement on the GPU.

They change only how the open gate computes (speed, and rounding within the high-quality
bar), never the closed gate. They are module-level so a benchmark can flip them and compare
in one process; tests and benchmarks restore what they change.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class KLSettings:
    # "chunked" (matmul + softmax by query chunks), "sdpa" (torch SDPA: the stock kernel at
    # d=512) or "auto" (chunked from ``chunked_min_tokens`` tokens up, where SDPA's
    # memory-efficient kernel is slow).
    attention: str = "auto"
    chunked_min_tokens: int = 8192
    # Scores and softmax in fp32 for half inputs (twice the score traffic, smaller logit error).
    attention_fp32_scores: bool = False
    # Nearest-2x + 3x3 conv as "transposed" (one 4x4 stride-2 conv_transpose2d), "subpixel"
    # (2x2 conv to 4*C channels + pixel shuffle) or "stock" (interpolate, then the 3x3 conv).
    upsample: str = "transposed"
    # cuDNN autotuning inside the open gate only (None: leave the global flag as it is).
    # Channels-last convs under cuDNN's heuristics are sometimes slower than contiguous ones.
    cudnn_benchmark: bool | None = None


settings = KLSettings()

ATTENTION_MODES = ("auto", "chunked", "sdpa")
UPSAMPLE_MODES = ("transposed", "subpixel", "stock")


@contextlib.contextmanager
def cudnn_benchmark_for(x: torch.Tensor) -> Iterator[None]:
    """Set cuDNN's benchmark flag for the decode of ``x`` (CUDA only) and restore it after.

    The flag is process-wide; it is set only for the duration of one open-gate decode, so a
    stock decode before or after sees the flag it had.
    """
    wanted = settings.cudnn_benchmark
    if wanted is None or x.device.type != "cuda" or torch.backends.cudnn.benchmark == wanted:
        yield
        return
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = wanted
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous
