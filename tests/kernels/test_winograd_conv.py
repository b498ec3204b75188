"""winograd_conv (F(4x4, 3x3): Triton transforms around cuBLAS-shaped products) against its
plain-torch twin and the direct conv, tier 1 (TRITON_INTERPRET, CPU)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.kernels.winograd_conv import (
    PATCH,
    WinogradLaunch,
    winograd_conv,
    winograd_conv_reference,
    winograd_conv_unsupported,
    winograd_input,
    winograd_input_reference,
    winograd_output,
    winograd_output_reference,
    winograd_weight,
)
from support.conv_inputs import conv_tensors, true_fp32_oracle  # noqa: F401 (autouse fixture)

SMALL = WinogradLaunch(block_t=4, block_c=16, num_warps=1)

SHAPES = [  # (input shape, Cout)
    ((1, 16, 8, 8), 16),  # whole tiles only
    ((2, 5, 7, 9), 3),  # batch 2, H and W not multiples of 4: partial tiles on two sides
    ((1, 24, 13, 4), 40),  # channels past one BLOCK_C (16) on both sides, not multiples of 16
    ((1, 6, 1, 1), 4),  # one pixel: every other patch value is the conv's zero padding
    ((3, 8, 5, 2), 8),  # tiles of consecutive samples in one program (block_t=4 > tiles per image)
]


@pytest.mark.parametrize("shape,cout", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(shape, cout, with_bias):
    x, w, b = conv_tensors(shape, cout, (3, 3))
    b = b if with_bias else None
    u = winograd_weight(w)
    n, _, h, wd = x.shape
    v = winograd_input(x, SMALL)
    # The transform is exact in fp32 for bf16 inputs (sums of at most 36 terms with small
    # integer coefficients); both round once to fp16.
    torch.testing.assert_close(v, winograd_input_reference(x), rtol=2.0**-10, atol=0)
    m = torch.bmm(v.float(), u.float())
    y = winograd_output(m, (n, h, wd), b, x.dtype, SMALL)
    expected = winograd_output_reference(m, (n, h, wd), b, x.dtype)
    assert y.shape == (n, cout, h, wd) and y.is_contiguous(memory_format=torch.channels_last)
    # fp32 sums in another order than the oracle's, one rounding to bf16 each.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-8)
    torch.testing.assert_close(winograd_conv(x, u, b).float(),
                               winograd_conv_reference(x, w, b).float(), rtol=2.0**-7, atol=2.0**-8)


@pytest.mark.parametrize("shape,cout", SHAPES, ids=lambda v: str(v))
def test_reference_is_the_convolution(shape, cout):
    """The twin computes conv2d(x, w, b, padding=1), up to its fp16 products."""
    x, w, b = conv_tensors(shape, cout, (3, 3))
    expected = F.conv2d(x.float(), w.float(), b.float(), padding=1)
    got = winograd_conv_reference(x, w, b).float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.02 * scale


def test_weight_layout():
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    g = torch.tensor([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                      [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], dtype=torch.float64)
    u = winograd_weight(w)
    assert u.shape == (PATCH * PATCH, 2, 3) and u.dtype == torch.float16
    # entry (i * 6 + l, c, o) is (G w[o, c] G^T)[i, l]
    torch.testing.assert_close(u[2 * 6 + 5, 1, 2].double(), (g @ w[2, 1] @ g.T)[2, 5], rtol=1e-3, atol=1e-4)


def test_as_close_to_fp32_as_a_bf16_direct_conv():
    """fp16 products with fp32 M keep the error within 2x a bf16 direct conv's, from the same
    bf16 input, on SiLU'd activations as a VAE's convs see them (kernels/winograd_conv.py's
    note: 1.4-1.7x measured; a bf16 V would be about 10x)."""
    g = torch.Generator().manual_seed(1)
    c = 64
    x32 = F.silu(torch.randn(1, c, 16, 16, generator=g) * 1.5 + 0.3)
    w32 = torch.randn(c, c, 3, 3, generator=g) / math.sqrt(9 * c)
    ref = F.conv2d(x32.double(), w32.double(), padding=1)
    x = x32.bfloat16().contiguous(memory_format=torch.channels_last)
    w = w32.bfloat16()
    direct = F.conv2d(x.float(), w.float(), padding=1).bfloat16().double()
    wino = winograd_conv(x, winograd_weight(w)).double()
    rms = lambda y: (y - ref).pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(wino) <= 2 * rms(direct)


def test_unsupported():
    x, w, _ = conv_tensors((1, 8, 4, 4), 8, (3, 3))
    u = winograd_weight(w)
    assert winograd_conv_unsupported(x, u) is None
    assert "channels-last" in winograd_conv_unsupported(x.contiguous(), u)
    assert winograd_conv_unsupported(x.float(), u) is not None
    assert "does not fit" in winograd_conv_unsupported(x, winograd_weight(w[:, :4]))
