"""narrow_conv (tap products + tap sum, Triton) against its plain-torch twin, tier 1
(TRITON_INTERPRET, CPU). Real sizes on the GPU: test_narrow_conv_gpu.py."""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.group_norm_silu import NormSiLU
from fast_vae_decode.kernels.implicit_gemm_conv import ConvConfig
from fast_vae_decode.kernels.narrow_conv import (
    NarrowWeight,
    narrow_conv,
    narrow_conv_reference,
    narrow_conv_unsupported,
    pack_narrow_conv_weight,
    prologue_reference,
)
from support.conv_inputs import conv_tensors

SMALL = ConvConfig(32, 16, 16, 4, 2)

CASES = [  # (input shape, Cout, kernel, padding)
    ((2, 20, 5, 7), 3, (3, 3), 1),  # an image head: batch 2, odd H/W, Cin not a multiple of 16
    ((1, 12, 4, 3, 5), 3, (3, 3, 3), (0, 1, 1)),  # Wan's head on an assembled causal buffer
    ((1, 8, 1, 4, 5), 3, (1, 3, 3), (0, 1, 1)),  # one uncached frame: the last temporal tap
    ((1, 16, 3, 4, 4), 12, (3, 3, 3), (1, 1, 1)),  # Wan 2.2's 12 channels; padding in time
    ((1, 6, 1, 1), 3, (3, 3), 1),  # one pixel: every neighbour tap is padding
    ((1, 8, 6, 5), 2, (3, 3), 0),  # no padding: a smaller output
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}k{c[2]}")
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(case, with_bias):
    shape, cout, kernel, padding = case
    x, w, b = conv_tensors(shape, cout, kernel)
    b = b if with_bias else None
    y = narrow_conv(x, pack_narrow_conv_weight(w), padding, b, config=SMALL)
    expected = narrow_conv_reference(x, w, b, padding)
    assert y is not None and y.shape == expected.shape
    assert y.is_contiguous(memory_format=torch.channels_last if x.dim() == 4
                           else torch.channels_last_3d)
    # fp32 sums in another order than the oracle's, one rounding to bf16 each.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-8)


def test_default_tiling():
    x, w, b = conv_tensors((1, 96, 3, 4, 6), 3, (3, 3, 3))
    y = narrow_conv(x, pack_narrow_conv_weight(w), (0, 1, 1), b)
    torch.testing.assert_close(y.float(), narrow_conv_reference(x, w, b, (0, 1, 1)).float(),
                               rtol=2.0**-7, atol=2.0**-8)


def test_packed_columns():
    w = torch.arange(3 * 2 * 3 * 3, dtype=torch.float32).reshape(3, 2, 3, 3)
    packed = pack_narrow_conv_weight(w)
    assert isinstance(packed, NarrowWeight) and packed.taps.shape == (1, 1, 1, 2, 32)
    assert (packed.cout, packed.kh, packed.kw, packed.kt) == (3, 3, 3, 1)
    # column (kh * 3 + kw) * 3 + co holds w[co, c, kh, kw]; the padding columns are zero
    assert packed.taps[0, 0, 0, 1, (2 * 3 + 1) * 3 + 2] == w[2, 1, 2, 1]
    assert not packed.taps[..., 27:].any()


def test_declines():
    x, w, b = conv_tensors((1, 8, 4, 4), 3, (3, 3))
    packed = pack_narrow_conv_weight(w)
    assert narrow_conv_unsupported(x, packed) is None
    assert narrow_conv_unsupported(x.contiguous(), packed) == "channels not innermost"
    assert narrow_conv(x.contiguous(), packed) is None
    assert narrow_conv_unsupported(x, w) == "weight not packed by pack_narrow_conv_weight"
    assert "channels" in narrow_conv_unsupported(x[:, :4], packed)
    wide = pack_narrow_conv_weight(torch.zeros((32, 8, 3, 3), dtype=torch.bfloat16))
    assert "at most" in narrow_conv_unsupported(x, wide)
    assert "bias" in narrow_conv_unsupported(x, packed, 1, b[:2])
    assert narrow_conv_unsupported(x, packed, 3) == "padding 3"


def _prologue(x, silu=True, seed=1):
    """Per-sample, per-channel factors of a plausible norm (scales around 1, shifts around 0),
    different for each sample so a mixed-up sample index shows."""
    g = torch.Generator().manual_seed(seed)
    n, c = x.shape[:2]
    scale = (1.0 + 0.5 * torch.randn((n, c), generator=g)).contiguous()
    shift = (0.5 * torch.randn((n, c), generator=g)).contiguous()
    return NormSiLU(scale, shift, silu)


PROLOGUE_CASES = [  # (input shape, Cout, padding, tiling)
    ((2, 20, 5, 7), 3, 1, SMALL),  # batch 2, odd H/W, Cin not a multiple of BLOCK_K (16)
    ((1, 40, 3, 9), 3, 1, ConvConfig(32, 32, 32, 4, 2)),  # a masked second channel block
    ((1, 6, 1, 1), 3, 1, SMALL),  # one pixel: every neighbour tap is padding, after the prologue
    ((1, 8, 6, 5), 2, 0, SMALL),  # no padding: a smaller output
    ((3, 16, 4, 4), 3, 1, ConvConfig(128, 32, 16, 4, 2)),  # a row tile wider than a sample
]


@pytest.mark.parametrize("case", PROLOGUE_CASES, ids=lambda c: f"{c[0]}->{c[1]}p{c[2]}")
@pytest.mark.parametrize("silu", [True, False])
def test_prologue_matches_reference(case, silu):
    shape, cout, padding, config = case
    x, w, b = conv_tensors(shape, cout, (3, 3))
    prologue = _prologue(x, silu)
    y = narrow_conv(x, pack_narrow_conv_weight(w), padding, b, config=config, prologue=prologue)
    expected = narrow_conv_reference(x, w, b, padding, prologue=prologue)
    assert y is not None and y.shape == expected.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    # The twin rounds the activation as the kernel does, up to fp32 contraction (one bf16 step
    # of an activation, rarely), then fp32 sums in another order and one rounding each.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-6, atol=2.0**-7)


def test_prologue_is_the_conv_of_the_prologue_applied_first():
    # The fused pass 1 convolves exactly what a norm pass would have stored.
    x, w, b = conv_tensors((2, 24, 6, 5), 3, (3, 3))
    prologue = _prologue(x)
    packed = pack_narrow_conv_weight(w)
    fused = narrow_conv(x, packed, 1, b, config=SMALL, prologue=prologue)
    unfused = narrow_conv(prologue_reference(x, prologue), packed, 1, b, config=SMALL)
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2.0**-7, atol=2.0**-8)


def test_prologue_declines():
    x, w, b = conv_tensors((1, 8, 4, 4), 3, (3, 3))
    packed = pack_narrow_conv_weight(w)
    prologue = _prologue(x)
    assert narrow_conv_unsupported(x, packed, 1, b, prologue) is None
    half = NormSiLU(prologue.scale.bfloat16(), prologue.shift, True)
    assert "fp32" in narrow_conv_unsupported(x, packed, 1, b, half)
    other_batch = _prologue(torch.cat([x, x]))
    assert narrow_conv_unsupported(x, packed, 1, b, other_batch).startswith("prologue scale")
    assert narrow_conv(x, packed, 1, b, prologue=half) is None
    wide, _, _ = conv_tensors((1, 8, 4, 8), 3, (3, 3))  # every other column: channels innermost,
    strided = wide[:, :, :, ::2]  # which narrow_conv takes, but not densely packed pixels
    assert narrow_conv_unsupported(strided, packed, 1, b) is None
    assert "dense" in narrow_conv_unsupported(strided, packed, 1, b, prologue)
    v, w3, b3 = conv_tensors((1, 8, 3, 4, 4), 3, (3, 3, 3))
    assert narrow_conv_unsupported(v, pack_narrow_conv_weight(w3), (0, 1, 1), b3,
                                   _prologue(v)) == "a prologue on a 3-D conv"
