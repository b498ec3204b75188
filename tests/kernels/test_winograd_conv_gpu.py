"""winograd_conv at the KL decoders' real sizes on a GPU (tier 3, ``cuda``), against its
plain-torch twin, and past 2^31 elements of V. Small edge shapes under the interpreter are
tier 1, in test_winograd_conv.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.kernels.winograd_conv import (
    winograd_conv,
    winograd_conv_reference,
    winograd_weight,
)
from support.conv_inputs import conv_tensors, true_fp32_oracle  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.cuda

CASES = [  # (input shape, Cout)
    ((1, 512, 128, 128), 512),  # SDXL / Flux mid block and first up block
    ((4, 512, 96, 64), 512),  # SD1.5 768x512 batch 4, first stage
    ((1, 512, 256, 256), 256),  # a 512 -> 256 resnet conv
    ((1, 128, 130, 98), 128),  # sides not multiples of 4: partial tiles on both
]


@pytest.mark.parametrize("shape,cout", CASES, ids=lambda v: str(v))
def test_matches_reference_at_real_sizes(shape, cout):
    x, w, b = conv_tensors(shape, cout, (3, 3), device="cuda")
    y = winograd_conv(x, winograd_weight(w), b)
    expected = winograd_conv_reference(x, w, b)
    assert y.shape == expected.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-7)


def test_offsets_past_2_to_the_31():
    """V of 256 channels at 2048² has 36 * 512² * 256 = 2.4e9 entries: int64 plane offsets.
    The last rows (the highest offsets) against cuDNN's fp32 conv of the same rows."""
    x, w, b = conv_tensors((1, 256, 2048, 2048), 8, (3, 3), device="cuda")
    y = winograd_conv(x, winograd_weight(w), b)
    rows = x[:, :, -10:].float()
    expected = F.conv2d(rows, w.float(), b.float(), padding=1)[:, :, 1:]  # row 0 lacks its top
    got = y[:, :, -9:].float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    assert torch.isfinite(y).all()
