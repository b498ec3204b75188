"""Inputs, tolerances and the kernel-vs-reference check shared by the group_norm_silu tests
(tests/kernels/test_group_norm_silu.py, tier 1, and test_group_norm_silu_gpu.py, tier 3)."""
from __future__ import annotations

import torch

from fast_vae_decode.kernels.group_norm_silu import (
    group_norm_silu,
    group_norm_silu_reference,
    group_norm_silu_unsupported,
)

EPS = 1e-6  # what KL VAE decoders use


# Kernel vs reference, per dtype, as (rtol, atol):
# - fp32: both compute in fp32 but sum in different orders and the kernel folds the affine into
#   one scale/shift per channel; outputs are O(10), so a few ULP is ~1e-6. 1e-5 leaves margin.
# - bf16/fp16: both round fp32 values that agree to ~1e-6 into the output dtype, so they differ by
#   one output ULP at most, i.e. at most 2^-7 (bf16) / 2^-10 (fp16) of the value (measured: up to
#   exactly that); rtol allows two ULPs. atol covers fp32 noise where the value is near zero.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2.0**-6, 1e-5),
    torch.float16: (2.0**-9, 1e-5),
}


def _input(n, c, h, w, dtype, mean=1.0, std=3.0, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g) * std + mean
    return x.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


def _affine(c, device="cpu", dtype=torch.float32, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(c, generator=g) * 0.5 + 1.0
    b = torch.randn(c, generator=g) * 0.5
    return w.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def _check(x, weight, bias, g, silu=True, config=None, tol=None, input_bias=None):
    before = x.clone()
    y = group_norm_silu(x, weight, bias, g, EPS, silu, config=config, input_bias=input_bias)
    assert y is not None, group_norm_silu_unsupported(x, weight, bias, g, input_bias)
    ref = group_norm_silu_reference(x, weight, bias, g, EPS, silu, input_bias=input_bias)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.permute(0, 2, 3, 1).is_contiguous()
    assert torch.equal(x, before)  # a new tensor; the input is untouched
    rtol, atol = tol or TOL[x.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol)
    return y, ref
