"""Folding nearest-2x upsample + 3x3 conv into one low-resolution op (tier 1, CPU)."""

from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.upsample_conv_fold import (
    fold_upsample_conv_weight,
    fold_upsample_conv_weight_subpixel,
    upsample_conv_folded,
    upsample_conv_reference,
    upsample_conv_subpixel,
)

SHAPES = [  # (N, Cin, Cout, H, W)
    (2, 3, 5, 5, 7),  # odd, non-square, N > 1, Cin != Cout: any index or transpose slip shows
    (1, 4, 2, 1, 1),  # one pixel: every neighbour tap falls in the zero padding
    (1, 2, 3, 2, 9),  # even/odd mix, W much larger than H: catches swapped axes
]

PATHS = {
    "transposed": (fold_upsample_conv_weight, upsample_conv_folded),
    "subpixel": (fold_upsample_conv_weight_subpixel, upsample_conv_subpixel),
}


def _case(shape, dtype, seed=0):
    n, cin, cout, h, w = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cin, h, w, generator=g, dtype=torch.float64)
    weight = torch.randn(cout, cin, 3, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(cout, generator=g, dtype=torch.float64)
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


def _magnitude(x, weight, bias):
    """|x| * |w| + |b| through the stock op in fp64: the scale of each output's rounding."""
    return upsample_conv_reference(x.double().abs(), weight.double().abs(), bias.double().abs())


def test_transposed_taps_match_the_stated_per_axis_sums():
    # Per axis: transposed tap 0 = w2, 1 = w1+w2, 2 = w0+w1, 3 = w0; 2-D taps are products.
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    axis = [[2], [1, 2], [0, 1], [0]]
    folded = fold_upsample_conv_weight(w)
    assert folded.shape == (2, 3, 4, 4)
    for a in range(4):
        for b in range(4):
            expected = sum(w[:, :, i, j] for i in axis[a] for j in axis[b]).T
            torch.testing.assert_close(folded[:, :, a, b], expected, rtol=0, atol=1e-15)


def test_subpixel_weight_shape_and_taps():
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    w4 = fold_upsample_conv_weight_subpixel(w)
    assert w4.shape == (12, 2, 2, 2)
    # Slot 1 on both axes is the even/even phase: window (m-1, m) with taps [w0, w1+w2].
    even = w4.view(3, 2, 2, 2, 2, 2)[:, 1, 1]
    torch.testing.assert_close(even[..., 0, 0], w[..., 0, 0], rtol=0, atol=0)
    torch.testing.assert_close(even[..., 1, 1], w[..., 1:, 1:].sum((-1, -2)), rtol=0, atol=1e-15)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_folded_equals_upsample_then_conv(path, shape, dtype):
    fold, run = PATHS[path]
    x, weight, bias = _case(shape, dtype)
    expected = upsample_conv_reference(x, weight, bias)
    got = run(x, fold(weight), bias)
    assert got.shape == expected.shape == (shape[0], shape[2], 2 * shape[3], 2 * shape[4])
    assert got.dtype == dtype
    # Standard dot-product error bound, both paths against exact arithmetic: the stock path
    # sums 9*Cin products (+ bias), the folded one 4*Cin products of weights that carry up to 3
    # roundings of their own; each is within (terms + 3) * eps * sum|x||w| (+|b|). Bugs give
    # errors of order 1 relative, far above this.
    unit = torch.finfo(dtype).eps
    bound = (13 * shape[1] + 8) * unit * _magnitude(x, weight, bias)
    assert ((got.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_channels_last_input(path):
    # The fast decoder runs channels-last; the fold must not depend on the memory format.
    fold, run = PATHS[path]
    x, weight, bias = _case(SHAPES[0], torch.float64, seed=1)
    got = run(x.contiguous(memory_format=torch.channels_last), fold(weight), bias)
    expected = upsample_conv_reference(x, weight, bias)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)  # fp64: ~1e-15 rounding
    if path == "subpixel":
        assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bf16_close_to_exact(path):
    fold, run = PATHS[path]
    x, weight, bias = _case(SHAPES[0], torch.bfloat16, seed=2)
    folded = fold(weight)
    assert folded.dtype == torch.bfloat16
    got = run(x, folded, bias).double()
    exact = upsample_conv_reference(x.double(), weight.double(), bias.double())
    # Against exact math on the same bf16 inputs: each folded weight is rounded once (fp32
    # sums, one cast), the output once, with accumulation in fp32 or better; that is 2 unit
    # roundoffs of |x||w| + |b|. Factor 4 margin for backends that round partial sums.
    unit = torch.finfo(torch.bfloat16).eps / 2
    bound = 8 * unit * _magnitude(x, weight, bias)
    assert ((got - exact).abs() <= bound).all()


def test_no_bias():
    # Diffusers' Upsample2D convs always have a bias, but the op must not require one.
    x, weight, _ = _case(SHAPES[0], torch.float64, seed=3)
    expected = upsample_conv_reference(x, weight, None)
    for fold, run in PATHS.values():
        torch.testing.assert_close(run(x, fold(weight), None), expected, rtol=1e-12, atol=1e-12)


def test_subpixel_accepts_a_pre_repeated_bias():
    x, weight, bias = _case(SHAPES[0], torch.float64, seed=4)
    w4 = fold_upsample_conv_weight_subpixel(weight)
    torch.testing.assert_close(  # fp64 rounding only
        upsample_conv_subpixel(x, w4, bias.repeat_interleave(4)),
        upsample_conv_reference(x, weight, bias),
        rtol=1e-12,
        atol=1e-12,
    )


def test_rejects_non_3x3_weight():
    with pytest.raises(ValueError):
        fold_upsample_conv_weight(torch.zeros(2, 2, 1, 1))
