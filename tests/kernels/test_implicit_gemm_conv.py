"""implicit_gemm_conv (Triton) against its plain-torch twin, tier 1 (TRITON_INTERPRET, CPU).

Small edge shapes: odd and non-square pixels, channel counts that are not multiples of 16 (the
masked reduction and column tails), batch > 1, one frame, a 3-channel head, padding in every
axis, a residual; and a pixel offset past 2^31 elements (int64 row offsets). Real sizes run on
the GPU in test_implicit_gemm_conv_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.implicit_gemm_conv import (
    ConvConfig,
    default_config,
    implicit_gemm_conv,
    implicit_gemm_conv_reference,
    implicit_gemm_conv_unsupported,
    output_shape,
    pack_conv_weight,
)
from support.conv_inputs import conv_tensors

SMALL = ConvConfig(32, 16, 16, 4, 2)  # several row, column and reduction tiles at these sizes
# The TMA variant: 4 x 8 pixel rectangles; edges, padding and channel tails come from the copy
# engine's zero fill (the interpreter models it).
SMALL_TMA = ConvConfig(32, 16, 16, 4, 2, tma=True, tma_width=8)

CASES = [  # (input shape, Cout, kernel, padding)
    ((2, 20, 5, 7), 24, (3, 3), 1),  # batch 2, odd H/W, Cin and Cout not multiples of 16
    ((1, 4, 6, 9), 3, (3, 3), 1),  # a latent conv_in's 4 channels into a head's 3
    ((3, 8, 5, 5), 40, (1, 1), 0),  # 1x1 (a shortcut), batch 3
    ((1, 12, 4, 3, 5), 12, (3, 3, 3), (0, 1, 1)),  # causal 3x3x3 on an assembled buffer
    ((1, 16, 1, 4, 4), 20, (1, 3, 3), (0, 1, 1)),  # one frame: the taps that meet it
    ((2, 6, 3, 3, 2), 5, (3, 3, 3), 1),  # padding in time too, batch 2, 5 outputs
    ((1, 16, 4, 3, 3), 32, (3, 1, 1), 0),  # Wan's temporal-only time_conv
]


def _memory_format(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 4 else torch.channels_last_3d


def _tensors(shape, cout, kernel, padding, residual, seed=0):
    x, w, b = conv_tensors(shape, cout, kernel, seed=seed)
    res = None
    if residual:
        g = torch.Generator().manual_seed(seed + 1)
        out_shape = output_shape(shape, pack_conv_weight(w).shape, padding)
        res = torch.randn(out_shape, generator=g).bfloat16().contiguous(
            memory_format=_memory_format(len(shape)))
    return x, w, b, res


def _close(y, expected):
    # fp32 sums in another order than the oracle's, one rounding to bf16 each: within 2 ULPs.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}k{c[2]}")
@pytest.mark.parametrize("residual", [False, True])
def test_matches_reference(case, residual):
    shape, cout, kernel, padding = case
    x, w, b, res = _tensors(shape, cout, kernel, padding, residual)
    y = implicit_gemm_conv(x, pack_conv_weight(w), padding, b, res, SMALL)
    assert y is not None
    assert y.is_contiguous(memory_format=_memory_format(x.dim()))
    _close(y, implicit_gemm_conv_reference(x, w, b, padding, res))


@pytest.mark.parametrize("case", [
    ((2, 24, 5, 7), 40, (3, 3), 1),  # Cin 24 in 16-channel blocks: the tail meets zeros
    ((1, 16, 4, 3, 5), 16, (3, 3, 3), (0, 1, 1)),  # frames flattened into one axis
    ((2, 16, 3, 9, 20), 24, (3, 3, 3), (0, 1, 1)),  # batch 2: the frame index crosses samples
    ((3, 16, 5, 5), 8, (1, 1), 0),
], ids=lambda c: f"{c[0]}->{c[1]}k{c[2]}")
@pytest.mark.parametrize("residual", [False, True])
def test_tma_variant(case, residual):
    from fast_vae_decode.kernels.implicit_gemm_conv import tma_reason

    shape, cout, kernel, padding = case
    x, w, b, res = _tensors(shape, cout, kernel, padding, residual)
    packed = pack_conv_weight(w)
    assert tma_reason(x, packed, padding, x.dtype, res, SMALL_TMA) is None
    y = implicit_gemm_conv(x, packed, padding, b, res, SMALL_TMA)
    _close(y, implicit_gemm_conv_reference(x, w, b, padding, res))


def test_tma_variant_steps_aside():
    from fast_vae_decode.kernels.implicit_gemm_conv import tma_reason

    x, w, b, _ = _tensors((2, 16, 6, 5, 4), 16, (3, 3, 3), (0, 1, 1), False)
    packed = pack_conv_weight(w)
    view = x[:, :, 2:]  # a frame slice of a batch of 2: samples not dense
    assert tma_reason(view, packed, (0, 1, 1), x.dtype, None, SMALL_TMA) == \
        "input not dense channels-last"
    assert tma_reason(x, packed, 1, x.dtype, None, SMALL_TMA) == "time padding"
    head = pack_conv_weight(w[:3])
    assert "16-byte" in tma_reason(x, head, (0, 1, 1), x.dtype, None, SMALL_TMA)
    # ... and the pointer variant computes it instead
    y = implicit_gemm_conv(view, packed, (0, 1, 1), b, config=SMALL_TMA)
    _close(y, implicit_gemm_conv_reference(view, w, b, (0, 1, 1)))


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) == 5],
                         ids=lambda c: f"{c[0]}->{c[1]}k{c[2]}")
def test_frames_innermost_rows(case):
    # time_inner orders the GEMM rows (n, h, w, t); the result must not change.
    shape, cout, kernel, padding = case
    x, w, b, res = _tensors(shape, cout, kernel, padding, True)
    cfg = ConvConfig(32, 16, 16, 4, 2, time_inner=True)
    y = implicit_gemm_conv(x, pack_conv_weight(w), padding, b, res, cfg)
    _close(y, implicit_gemm_conv_reference(x, w, b, padding, res))


def test_default_config_and_no_bias():
    x, w, _, _ = _tensors((1, 96, 3, 5), 3, (3, 3), 1, False)
    y = implicit_gemm_conv(x, pack_conv_weight(w), 1)  # default_config: 32-channel blocks
    assert default_config(96, 3).block_k == 32
    _close(y, implicit_gemm_conv_reference(x, w, None, 1))


def test_frame_slice_input():
    # A time slice of a channels-last-3d buffer: channels innermost, the frame stride larger
    # than the slice's own frames (the Wan decoder's assembled causal input).
    x, w, b, _ = _tensors((1, 16, 6, 5, 4), 16, (3, 3, 3), (0, 1, 1), False)
    view = x[:, :, 2:]
    y = implicit_gemm_conv(view, pack_conv_weight(w), (0, 1, 1), b, config=SMALL)
    _close(y, implicit_gemm_conv_reference(view, w, b, (0, 1, 1)))


def test_offsets_past_int32():
    # Sample 1 starts 2^31 + 64 elements after sample 0: an int32 pixel offset would wrap and
    # read the wrong memory. The storage is never touched outside the two samples (virtual).
    c, h, w_ = 16, 3, 5
    stride_n = 2**31 + 64
    try:
        storage = torch.empty(stride_n + c * h * w_, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("no 4 GiB of address space for the stride-forcing tensor")
    x = storage.as_strided((2, c, h, w_), (stride_n, 1, w_ * c, c))
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        x[i] = torch.randn((c, h, w_), generator=g).bfloat16()
    weight = (torch.randn((8, c, 3, 3), generator=g) / 12).bfloat16()
    y = implicit_gemm_conv(x, pack_conv_weight(weight), 1, config=SMALL)
    expected = implicit_gemm_conv_reference(torch.stack([x[0], x[1]]), weight, None, 1)
    _close(y, expected)


def test_declines():
    x, w, b, _ = _tensors((1, 8, 4, 4), 8, (3, 3), 1, False)
    packed = pack_conv_weight(w)
    assert implicit_gemm_conv_unsupported(x.float(), packed.float()) == "dtype torch.float32"
    nchw = x.contiguous()
    assert implicit_gemm_conv_unsupported(nchw, packed) == "channels not innermost"
    assert implicit_gemm_conv(nchw, packed) is None
    assert "channels" in implicit_gemm_conv_unsupported(x[:, :4], packed)
    assert implicit_gemm_conv_unsupported(x, w) == "weight not packed by pack_conv_weight"
    w3 = pack_conv_weight(torch.zeros((8, 8, 3, 1, 1), dtype=torch.bfloat16))
    assert implicit_gemm_conv_unsupported(x, w3, 0) == "a 3-D weight for a 4-D input"
    assert "bias" in implicit_gemm_conv_unsupported(x, packed, 1, b[:4])
    assert "residual" in implicit_gemm_conv_unsupported(x, packed, 1, b, x[:, :, :2])


def test_pack_conv_weight_layout():
    w = torch.arange(2 * 3 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3, 3)
    packed = pack_conv_weight(w)
    assert packed.shape == (1, 3, 3, 3, 2) and packed.is_contiguous()
    assert packed[0, 1, 2, 0, 1] == w[1, 0, 1, 2]
