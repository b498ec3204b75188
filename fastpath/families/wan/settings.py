"""Switches of the Wan video-VAE fast path that are chosen by measurement on the GPU.

As the KL wing's (``families/kl/settings.py``): they change only how the open gate computes,
never the closed gate, and are module-level so a benchmark can flip them in one process
(``bench --setting wan.NAME=VALUE``); tests and benchmarks restore what they change.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WanSettings:
    # The mid-block's per-frame attention: "chunked" (cuBLAS score and value GEMMs by chunks of
    # query rows, the in-place ``softmax_rows`` between them) or "sdpa" (torch SDPA: its
    # memory-efficient kernel, as stock, at head dims past the flash kernel's 256).
    attention: str = "chunked"
    # Score bytes one chunk may hold (``attention_chunk_size``): a 1024² Qwen-Image frame has
    # 16384 tokens, 1 GiB of bf16 scores and probabilities at once; a quarter keeps the
    # mid-block's transient memory well below the full-resolution stages' peak.
    attention_budget_bytes: int = 1 << 28


settings = WanSettings()

ATTENTION_MODES = ("chunked", "sdpa")
CHOICES: dict[str, tuple[str, ...]] = {"attention": ATTENTION_MODES}
