"""bias_residual_add_ (Triton, channels-last, in place) against its plain-torch reference.

Tier 1: the kernel runs under TRITON_INTERPRET on small shapes. (Tier 3, a tensor whose element
offsets exceed int32 on a GPU, is in test_bias_residual_add_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.bias_residual_add import (
    bias_residual_add_,
    bias_residual_add_reference,
    bias_residual_add_unsupported,
)

SHAPES = [
    (1, 64, 8, 8),  # KL-like: power-of-two channels, several tiles
    (2, 3, 5, 7),  # conv_out's 3 channels (tile column padded to 4), batch 2, odd pixel count
    (1, 96, 3, 5),  # channels not a power of two; fewer pixels than one tile holds
]

# The kernel and the reference both add in fp32 and round once to the output dtype, in the
# same order (out + bias, then + residual); only fp32 contraction could differ, by an ULP.
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2.0**-7, 1e-6)}


def _tensors(shape, dtype, residual, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    out = out.contiguous(memory_format=torch.channels_last)
    bias = torch.randn(shape[1], generator=g).to(device=device, dtype=dtype)
    res = None
    if residual:
        res = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        res = res.contiguous(memory_format=torch.channels_last)
    return out, bias, res


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_reference(shape, dtype, residual):
    out, bias, res = _tensors(shape, dtype, residual)
    expected = bias_residual_add_reference(out, bias, res)
    result = bias_residual_add_(out, bias, res)
    assert result is out  # in place
    assert out.is_contiguous(memory_format=torch.channels_last)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_residual_without_bias():
    out, _, res = _tensors((1, 16, 4, 4), torch.float32, True)
    expected = out + res
    assert bias_residual_add_(out, None, res) is out
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_reference_matches_torch_adds():
    out, bias, res = _tensors((1, 8, 3, 3), torch.float32, True)
    expected = out + bias.view(1, -1, 1, 1) + res
    torch.testing.assert_close(bias_residual_add_reference(out, bias, res), expected)


def test_unsupported_inputs_are_declined_untouched():
    out, bias, res = _tensors((1, 8, 4, 4), torch.float32, True)
    nchw = out.contiguous()
    before = nchw.clone()
    assert bias_residual_add_unsupported(nchw, bias, None) == "not channels-last"
    assert bias_residual_add_(nchw, bias, None) is None and torch.equal(nchw, before)
    assert "residual" in bias_residual_add_unsupported(out, bias, res.contiguous())
    assert "bias" in bias_residual_add_unsupported(out, bias[:4], None)
    assert bias_residual_add_unsupported(out, None, None) == "nothing to add"


# Addends (per-tap partial conv outputs) folded into the same pass; out as (shape, kind).
FOLD_CASES = [
    ((1, 96, 3, 5, 7), "fresh"),  # Wan's width C=96 (tile column padded to 128), 5-D
    # channels-last-3d, 105 pixels: more than one tile, the last partial
    ((1, 96, 3, 5, 7), "time-slice"),  # out a batch-1 time slice buf[:, :, 2:] of a
    # (1, C, T+2, H, W) cache buffer: channels inner dense, batch stride not that of a fresh one
    ((2, 32, 2, 3, 4), "fresh"),  # batch 2, power-of-two C: rows run across samples
    ((1, 16, 5, 6), "fresh"),  # 4-D channels-last takes addends too
]


def _like(shape, dtype, gen):
    fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    return torch.randn(shape, generator=gen).to(dtype).contiguous(memory_format=fmt)


def _fold_tensors(shape, kind, dtype, n_addends, residual, gen):
    """(out, buf, addends, bias, res). Addends and res are fresh tensors: for a time-slice out
    they differ from it only in the batch stride, which a batch of 1 never uses."""
    buf = None
    if kind == "time-slice":
        n, c, t, h, w = shape
        buf = _like((n, c, t + 2, h, w), dtype, gen)
        out = buf[:, :, 2:]
    else:
        out = _like(shape, dtype, gen)
    addends = tuple(_like(shape, dtype, gen) for _ in range(n_addends))
    bias = torch.randn(shape[1], generator=gen).to(dtype)
    res = _like(shape, dtype, gen) if residual else None
    return out, buf, addends, bias, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n_addends", [0, 1, 2])
@pytest.mark.parametrize("shape,kind", FOLD_CASES)
def test_addends_match_reference(shape, kind, n_addends, residual, dtype):
    gen = torch.Generator().manual_seed(1)
    out, buf, addends, bias, res = _fold_tensors(shape, kind, dtype, n_addends, residual, gen)
    head = None if buf is None else buf[:, :, :2].clone()
    expected = bias_residual_add_reference(out, bias, res, addends=addends)
    assert bias_residual_add_unsupported(out, bias, res, addends=addends) is None
    assert bias_residual_add_(out, bias, res, addends=addends) is out
    if buf is not None:
        assert torch.equal(buf[:, :, :2], head)  # frames before the slice untouched
    rtol, atol = TOL[dtype]  # same order of fp32 adds, one rounding each (see TOL)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_addends_without_bias_or_residual():
    gen = torch.Generator().manual_seed(2)
    out, _, addends, _, _ = _fold_tensors((1, 8, 2, 3, 3), "fresh", torch.float32, 2, False, gen)
    expected = out + addends[0] + addends[1]
    assert bias_residual_add_(out, None, None, addends=addends) is out
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_reference_addend_order():
    gen = torch.Generator().manual_seed(3)
    out, _, addends, bias, res = _fold_tensors((1, 8, 2, 3, 3), "fresh", torch.float32, 2, True,
                                               gen)
    expected = out + addends[0] + addends[1] + bias.view(1, -1, 1, 1, 1) + res
    torch.testing.assert_close(
        bias_residual_add_reference(out, bias, res, addends=addends), expected, rtol=0, atol=0
    )


def test_unsupported_addends_are_declined_untouched():
    gen = torch.Generator().manual_seed(4)
    out, _, addends, bias, _ = _fold_tensors((1, 8, 2, 3, 3), "fresh", torch.float32, 1, False,
                                             gen)
    before = out.clone()
    cases = {
        "strides": (addends[0].contiguous(),),
        "three": addends * 3,
        "dtype": (addends[0].to(torch.bfloat16),),
        "shape": (addends[0][:, :, :1],),
    }
    for name, bad in cases.items():
        assert isinstance(bias_residual_add_unsupported(out, bias, None, addends=bad), str), name
        assert bias_residual_add_(out, bias, None, addends=bad) is None, name
    assert torch.equal(out, before)
    # A batch-2 time slice is not one dense run of pixels (the kernel indexes rows flat).
    batch2 = _like((2, 8, 4, 3, 3), torch.float32, gen)[:, :, 2:]
    assert bias_residual_add_unsupported(batch2, bias, None) == "not channels-last"
