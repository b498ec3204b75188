"""The layout helper shared by the rms_norm_silu tests (tests/kernels/test_rms_norm_silu.py,
tier 1, and test_rms_norm_silu_gpu.py, tier 3)."""
from __future__ import annotations

import torch


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    return x.contiguous(memory_format=fmt)
