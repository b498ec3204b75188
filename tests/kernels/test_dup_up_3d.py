"""dup_up_3d (Wan 2.2's duplicating up-shortcut, channels-last-3d) against its plain-torch
reference and against diffusers' own ``DupUp3D`` module.

Tier 1: the kernel under TRITON_INTERPRET on small shapes. (Tier 3, real sizes and an output
past 2^31 elements, is in test_dup_up_3d_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.dup_up_3d import (
    dup_up_3d,
    dup_up_3d_reference,
    dup_up_3d_unsupported,
)

CASES = [
    # (in channels, out channels, factor_t, factor_s, frames, height, width, drop)
    (16, 16, 2, 2, 2, 3, 5, 0),  # Wan 2.2's temporal up-blocks: in == out, 8 slots each
    (16, 16, 2, 2, 1, 3, 5, 1),  # first chunk: one frame in, the leading output frame dropped
    (16, 8, 1, 2, 2, 4, 3, 0),  # spatial only, half the channels out (each repeats twice)
    (6, 12, 1, 2, 1, 5, 7, 0),  # channels not a power of two, odd sizes, more channels out
    (12, 3, 2, 2, 3, 2, 2, 1),  # fewer channels out than in: 24 slots, each input read twice
]


def _x(c, t, h, w, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, c, t, h, w, generator=g).to(dtype)
    return x.contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dup_up_3d_matches_the_reference_exactly(case, dtype):
    c_in, c_out, ft, fs, t, h, w, drop = case
    x = _x(c_in, t, h, w, dtype)
    out = dup_up_3d(x, c_out, ft, fs, drop)
    assert out is not None, dup_up_3d_unsupported(x, c_out, ft, fs, drop)
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(out, dup_up_3d_reference(x, c_out, ft, fs, drop))


def test_dup_up_3d_reads_any_input_strides():
    x = _x(16, 2, 3, 5)
    expected = dup_up_3d_reference(x, 16, 2, 2)
    for layout in (x.contiguous(), x[:, :, :, :, :].transpose(3, 4).contiguous().transpose(3, 4)):
        assert torch.equal(dup_up_3d(layout, 16, 2, 2), expected)


def test_dup_up_3d_matches_diffusers_dup_up_3d():
    wan = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")
    for c_in, c_out, ft, fs, t, h, w, drop in CASES:
        if drop not in (0, ft - 1):
            continue
        module = wan.DupUp3D(c_in, c_out, factor_t=ft, factor_s=fs)
        x = _x(c_in, t, h, w)
        stock = module(x.contiguous(), first_chunk=drop > 0)
        assert torch.equal(dup_up_3d(x, c_out, ft, fs, drop), stock)


@pytest.mark.parametrize("args, needle", [
    ((3, 1, 1, 0), "repeat"),  # 3 output slots cannot repeat 16 input channels evenly
    ((16, 2, 2, 4), "dropping"),  # as many frames dropped as the output has
])
def test_dup_up_3d_declines_with_a_reason(args, needle):
    x = _x(16, 2, 3, 5)
    reason = dup_up_3d_unsupported(x, *args)
    assert reason is not None and needle in reason
    assert dup_up_3d(x, *args) is None
