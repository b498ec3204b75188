"""softmax_rows (the KL attention's in-place row softmax) against torch's softmax.

Tier 1: the kernel under TRITON_INTERPRET on small shapes. (Tier 3, the attention's real chunk
shapes, is in test_softmax_rows_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import softmax_rows as sr
from fast_vae_decode.kernels.softmax_rows import (
    softmax_rows,
    softmax_rows_config,
    softmax_rows_reference,
    softmax_rows_unsupported,
)

SHAPES = [
    (1, 3, 16),  # a power-of-two row
    (2, 5, 37),  # odd rows and columns: masked lanes in the one-pass tile
    (1, 1, 1),  # one column: every probability is 1
    (4, 96),  # 2-D: any leading dims are rows
]


def _scores(shape, dtype, scale=8.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_rows_in_place_matches_torch(shape, dtype):
    s = _scores(shape, dtype)
    expected = softmax_rows_reference(s)
    out = softmax_rows(s)
    assert out is s  # in place: the scores' memory holds the probabilities
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of a value <= 1
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float().sum(-1), torch.ones(shape[:-1]), atol=2e-2, rtol=0)


def test_softmax_rows_writes_another_dtype_and_leaves_the_scores():
    s = _scores((2, 3, 40), torch.float32)
    kept = s.clone()
    out = torch.empty(s.shape, dtype=torch.bfloat16)
    assert softmax_rows(s, out=out) is out and torch.equal(s, kept)
    torch.testing.assert_close(out.float(), softmax_rows_reference(s).float(), atol=4e-3, rtol=4e-3)


def test_long_rows_take_the_two_pass_kernel(monkeypatch):
    # Rows longer than ONE_PASS_MAX are read twice with a running max and sum per lane; lowered
    # here so the interpreter meets several blocks and a ragged last one (37 = 2 x 16 + 5).
    monkeypatch.setattr(sr, "ONE_PASS_MAX", 8)
    monkeypatch.setattr(sr, "TWO_PASS_BLOCK", 16)
    assert softmax_rows_config(37)[:2] == (16, False)
    s = _scores((3, 37), torch.float32, scale=30.0)  # large logits: the running max matters
    expected = softmax_rows_reference(s)
    torch.testing.assert_close(softmax_rows(s), expected, atol=1e-6, rtol=1e-5)


def test_tiling_follows_the_row_length():
    # The H200 choices (softmax_rows.py's note): one pass up to 16384 keys, two beyond.
    assert softmax_rows_config(6144) == (8192, True, 8)  # SD1.5 768x512, Wan 2.1 480p frames
    assert softmax_rows_config(16384) == (16384, True, 4)  # SDXL / Flux 1024², Qwen-Image
    assert softmax_rows_config(65536) == (sr.TWO_PASS_BLOCK, False, sr.TWO_PASS_WARPS)  # 2048²


@pytest.mark.parametrize("make, needle", [
    (lambda: _scores((4, 8), torch.float32).t(), "not contiguous"),
    (lambda: torch.zeros(4, 8, dtype=torch.int32), "dtype"),
    (lambda: torch.zeros(0, 8), "empty"),
])
def test_softmax_rows_declines_what_it_cannot_take(make, needle):
    s = make()
    assert needle in softmax_rows_unsupported(s)
    assert softmax_rows(s) is None


def test_softmax_rows_declines_a_mismatched_out_and_writes_nothing():
    s = _scores((2, 8), torch.float32)
    kept = s.clone()
    for out in (torch.empty(2, 9), torch.empty(8, 2).t()):
        assert softmax_rows_unsupported(s, out) is not None
        assert softmax_rows(s, out=out) is None
    assert torch.equal(s, kept)


def test_scale_is_applied_to_the_scores_in_fp32():
    # An attention's 1/sqrt(d) taken in the kernel: softmax(scale * s), not softmax(s) * scale.
    s = _scores((3, 50), torch.bfloat16)
    expected = softmax_rows_reference(s, scale=0.125)
    torch.testing.assert_close(softmax_rows(s, scale=0.125).float(), expected.float(),
                               atol=4e-3, rtol=4e-3)
    assert "scale" in softmax_rows_unsupported(s, scale=0.0)
