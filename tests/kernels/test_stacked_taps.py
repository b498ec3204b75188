"""``stacked_taps``: a causal 3x3x3 conv as one 2-D conv over a channel-stacked input (tier 1,
CPU, fp64 so the only difference from conv3d is the summation order)."""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.stacked_taps import (
    fill_stacked_,
    new_stacked_input,
    slot_ranges,
    stacked_taps_conv,
    stacked_taps_reference,
    stacked_taps_weight,
)

# (C in, C out, frames out, H, W, pad): why each
SHAPES = [
    (6, 6, 4, 5, 7, 1),  # a 0.8-style chunk of four output frames, odd frame size
    (5, 3, 1, 3, 3, 1),  # one output frame; widths not multiples of 16; Cout != Cin
    (4, 4, 2, 1, 1, 0),  # a 1x1 frame without spatial padding (the conv's own padding rule)
]


@pytest.mark.parametrize("cin,cout,frames,h,w,pad", SHAPES)
def test_stacked_conv_is_the_conv3d_of_the_assembled_input(cin, cout, frames, h, w, pad):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, cin, frames + 2, h, w, generator=gen, dtype=torch.float64)
    weight = torch.randn(cout, cin, 3, 3 if pad else 1, 3 if pad else 1, generator=gen,
                         dtype=torch.float64)
    buffer = new_stacked_input(frames, cin, h, w, x.dtype, x.device)
    # In three runs as a decode fills it: zero frames, cached frames, new frames.
    fill_stacked_(buffer, None, 0, 1)
    fill_stacked_(buffer, x[:, :, 1:2], 1)
    fill_stacked_(buffer, x[:, :, 2:], 2)
    x[:, :, :1] = 0
    got = stacked_taps_conv(buffer, stacked_taps_weight(weight), pad, pad)
    expected = stacked_taps_reference(x, weight, pad, pad)
    assert got.shape == expected.shape == (1, cout, frames, h, w)
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("first,count,frames_out,expected", [
    (2, 4, 4, [(0, 0, 2), (1, 0, 3), (2, 0, 4)]),  # 0.8's chunk behind two cached frames: the
    # last two new frames are in no output's slot 0
    (0, 2, 4, [(0, 0, 2), (1, 1, 2)]),  # frames at the front: no output before frame 0
    (2, 2, 2, [(1, 0, 1), (2, 0, 2)]),  # 0.33's two-frame pieces: new frames fill slots 1-2
    (5, 1, 2, []),  # a frame past every output's reach
])
def test_slot_ranges(first, count, frames_out, expected):
    assert slot_ranges(first, count, frames_out) == expected
