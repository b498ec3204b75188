"""padded_grid_conv (CUTLASS DSL, Hopper) at Wan 2.1's real conv sizes and at small edge
shapes on a GPU (tier 3, ``cuda``), against its plain-torch twin (true fp32 conv of the padded
grid + bias, one rounding; + a residual, a second). Skipped without the optional ``nvidia-cutlass-dsl`` or off sm_90.
The layout math alone is tier 1, in test_padded_grid_conv.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import padded_grid_conv as pgc
from support.conv_inputs import conv_tensors, true_fp32_oracle  # noqa: F401 (autouse)

pytestmark = pytest.mark.cuda

CASES = [  # (C, Cout, frames out, H, W)
    (96, 96, 4, 480, 832),    # Wan 2.1 full resolution, 0.8's chunk of four frames
    (96, 96, 2, 480, 832),    # the same in 0.33's pieces of two
    (192, 192, 4, 240, 416),
    (192, 384, 2, 120, 208),  # the stage's first conv
    (384, 384, 2, 120, 208),
    (96, 96, 1, 5, 7),        # edge: one frame, odd sizes, fewer rows than one tile
    (384, 384, 3, 9, 13),     # edge: odd sizes across several tiles with 192-wide columns
]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return pgc.dsl_unavailable_reason(torch.device("cuda"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("epilogue", ["bias", "none", "bias+residual"])
def test_matches_the_twin(case, epilogue):
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    c, cout, t_out, h, w = case
    x, weight, bias = conv_tensors((1, c, t_out + 2, h, w), cout, (3, 3, 3), device="cuda")
    bias = bias.float() if epilogue != "none" else None
    residual = None
    if epilogue == "bias+residual" and c == cout:  # a residual block's second conv
        residual = x[:, :, 2:].contiguous(memory_format=torch.channels_last_3d)
    padded, interior = pgc.empty_padded(tuple(x.shape), x.dtype, x.device)
    interior.copy_(x)
    # Garbage in the slack rows must stay in the dropped rows.
    flat = padded.as_strided((padded.untyped_storage().nbytes() // 2,), (1,), 0)
    flat[padded.numel():] = float("nan")
    y = pgc.padded_grid_conv(padded, pgc.pack_padded_grid_weight(weight), bias, residual)
    expected = pgc.padded_grid_conv_reference(padded, weight, bias, residual)
    assert y is not None and y.shape == expected.shape
    assert y.is_contiguous(memory_format=torch.channels_last_3d)
    # bf16 output: at most a few roundings of values of magnitude ~1-4.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)


SWEPT = [(key, t) for key, tilings in pgc.SWEEP_TILINGS.items() for t in tilings]


@pytest.mark.parametrize("key,tiling", SWEPT, ids=lambda v: str(v).replace(" ", ""))
def test_a_sweep_tiling_matches_the_twin(key, tiling):
    """Every candidate the per-conv benchmark times, at two frames of 67x45 pixels: odd sizes,
    a last tile partly past the grid, frames straddling tiles; bias, and the residual where
    the conv keeps its width (the epilogue's every branch at that tiling)."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    c, cout, kt = key
    x, weight, bias = conv_tensors((1, c, 2 + kt - 1, 67, 45), cout, (kt, 3, 3), device="cuda")
    residual = x[:, :, kt - 1:].contiguous(memory_format=torch.channels_last_3d) if c == cout else None
    padded, interior = pgc.empty_padded(tuple(x.shape), x.dtype, x.device)
    interior.copy_(x)
    packed = pgc.pack_padded_grid_weight(weight)
    y = pgc.padded_grid_conv(padded, packed, bias.float(), residual, tiling=tiling)
    expected = pgc.padded_grid_conv_reference(padded, weight, bias.float(), residual)
    assert y is not None and y.shape == expected.shape
    torch.testing.assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)
