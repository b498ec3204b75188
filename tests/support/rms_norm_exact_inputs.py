"""Inputs and the bit-level comparison shared by the rms_norm_exact tests
(tests/kernels/test_rms_norm_exact.py, tier 1, and test_rms_norm_exact_gpu.py, tier 3)."""
from __future__ import annotations

import torch


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-level equality for floats: values, signs of zeros, NaN positions."""
    nan = torch.isnan(a)
    return (torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
            and torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan])))


def _inputs(shape, dtype, seed=0, zero_pixels=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    flat = x.view(-1)
    flat[::7] = 0.0
    flat[::11] = -0.0  # stock's "+ 0" turns these into +0.0
    if zero_pixels:
        x[..., 0] = 0.0  # all-zero pixels: the norm clamps to eps (NaN in fp16, where eps is 0)
    gshape = (shape[1],) + (1,) * (len(shape) - 2)
    gamma = (torch.rand(gshape, generator=gen) + 0.5).to(dtype)
    bias = (torch.randn(gshape, generator=gen) * 0.1).to(dtype)
    return x, gamma, bias
