"""dup_up_3d (Wan 2.2's duplicating up-shortcut) on a GPU.

Tier 3 (``cuda``): the decoder's real shortcut shapes against the plain-torch reference, and an
output past 2^31 elements. Small shapes under TRITON_INTERPRET are tier 1, in
test_dup_up_3d.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.dup_up_3d import dup_up_3d, dup_up_3d_reference

# Wan 2.2 704x1280 decoder shortcuts per chunk (in, out, factor_t, frames in, latent-scale h, w).
SHAPES = [
    (1024, 1024, 2, 1, 44, 80),  # first temporal up-block, first chunk (one frame in)
    (1024, 1024, 2, 2, 88, 160),  # second temporal up-block, steady chunk
    (1024, 512, 1, 4, 176, 320),  # spatial up-block to half the channels
]


@pytest.mark.cuda
@pytest.mark.parametrize("c_in, c_out, ft, t, h, w", SHAPES)
@pytest.mark.parametrize("first_chunk", [False, True])
def test_real_shortcut_shapes_match_the_reference(c_in, c_out, ft, t, h, w, first_chunk):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, c_in, t, h, w, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    drop = ft - 1 if first_chunk else 0
    out = dup_up_3d(x, c_out, ft, 2, drop)
    assert out is not None and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(out, dup_up_3d_reference(x, c_out, ft, 2, drop))


@pytest.mark.cuda
def test_offsets_beyond_int32_on_the_gpu():
    # Output 1 x 256 x 4 x 1024 x 2080 = 2.18e9 elements (> 2^31): int32 offsets would wrap.
    x = torch.arange(256, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    x = x.reshape(1, 256, 1, 1, 1).expand(1, 256, 2, 512, 1040).contiguous(
        memory_format=torch.channels_last_3d)
    x[0, :, -1, -1, -1] = -1.0  # the last input pixel, read only by the output's last pixels
    out = dup_up_3d(x, 256, 2, 2)
    assert out is not None and out.numel() > 2**31
    # 256 channels in and out, 8 slots each: output channel co reads input channel co.
    assert torch.equal(out[0, :, 0, 0, 0], x[0, :, 0, 0, 0])
    assert torch.equal(out[0, :, -1, -1, -1], x[0, :, -1, -1, -1])
    assert torch.equal(out[0, :, -2, -2, -2], x[0, :, -1, -1, -1])
    assert torch.equal(out[0, :, -3, -3, -3], x[0, :, 0, 0, 0])
