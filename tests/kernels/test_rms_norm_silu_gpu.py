"""``kernels.rms_norm_silu``: the fused Triton kernel vs its reference on a GPU.

Tier 3 (``cuda``): the sizes of a Wan 2.1 480x832 decode. Small shapes under
``TRITON_INTERPRET=1``, the reference vs the stock Wan ``RMS_norm`` formula, and the inputs the
kernel must refuse are tier 1, in test_rms_norm_silu.py.
"""

from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.rms_norm_silu import rms_norm_silu, rms_norm_silu_reference
from support.rms_norm_silu_inputs import _channels_last

CUDA_CASES = [
    ((1, 96, 4, 480, 832), torch.bfloat16),  # Wan 2.1 decoder, full resolution: 153M elements
    ((1, 384, 1, 60, 104), torch.bfloat16),  # Wan 2.1 decoder, latent resolution
    ((1, 1024, 1, 60, 104), torch.bfloat16),  # Wan 2.2 widest channels
    ((1, 96, 4, 480, 832), torch.float32),  # fp32 decode precision
    ((4, 384, 60, 104), torch.float16),  # 4-D attention-block norm, frames as batch, fp16
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype", CUDA_CASES)
def test_cuda_real_sizes(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(dtype))
    channels, ndim = shape[1], len(shape)
    gamma = (1.0 + 0.5 * torch.randn(channels, generator=gen, device="cuda")).reshape(
        (channels,) + (1,) * (ndim - 2)
    )
    bias = 0.3 * torch.randn_like(gamma)
    out = rms_norm_silu(x, gamma, bias)
    assert out is not None
    ref = rms_norm_silu_reference(x, gamma, bias)
    # As in tier 1: one rounding of an fp32 result each, so at most one ulp of dtype apart
    # (bf16 2**-7, fp16 2**-10 of the binade); fp32 differs only by reduction order.
    rtol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)


PIXEL_CASES = [
    ((1, 128, 17, 128, 192), True),  # LTX-2 decoder last stage (768x512), scale/shift + SiLU
    ((1, 1024, 16, 16, 24), True),  # LTX-2 decoder latent resolution, widest channels
    ((1, 128, 17, 128, 192), False),  # the decoder head's bare PixelNorm
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape,affine", PIXEL_CASES)
def test_cuda_pixel_norm_real_sizes(shape, affine):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16))
    c = shape[1]
    gamma = 1.0 + 0.2 * torch.randn(c, generator=gen, device="cuda") if affine else None
    bias = 0.2 * torch.randn(c, generator=gen, device="cuda") if affine else None
    kw = dict(eps=1e-8, silu=affine, mean_eps=True)
    out = rms_norm_silu(x, gamma, bias, **kw)
    assert out is not None
    torch.testing.assert_close(out, rms_norm_silu_reference(x, gamma, bias, **kw), rtol=2**-7, atol=1e-5)


@pytest.mark.cuda
def test_cuda_pixel_norm_into_a_reflect_padded_conv_input():
    # LTX-2's last stage (768x512), written as the interior of its conv's input buffer (two
    # cached frames in front, a reflected border): 192 frame rows over 64-pixel tiles, so
    # tiles with and without border pixels.
    gen = torch.Generator(device="cuda").manual_seed(2)
    shape = (1, 128, 17, 128, 192)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16))
    gamma = 1.0 + 0.2 * torch.randn(128, generator=gen, device="cuda")
    bias = 0.2 * torch.randn(128, generator=gen, device="cuda")
    buf = _channels_last(torch.zeros((1, 128, 19, 130, 194), device="cuda", dtype=torch.bfloat16))
    inner = buf[:, :, 2:, 1:-1, 1:-1]
    kw = dict(eps=1e-8, silu=True, mean_eps=True)
    assert rms_norm_silu(x, gamma, bias, out=inner, out_border=1, **kw) is inner
    ref = rms_norm_silu_reference(x, gamma, bias, **kw)
    want = torch.nn.functional.pad(ref.reshape(1, 128 * 17, 128, 192), (1, 1, 1, 1), mode="reflect")
    torch.testing.assert_close(buf[:, :, 2:], want.reshape(1, 128, 17, 130, 194), rtol=2**-7, atol=1e-5)
    assert not buf[:, :, :2].any()


@pytest.mark.cuda
@pytest.mark.parametrize("frames,tail_frames", [(4, 2), (2, 2)])
def test_cuda_frame_tail_at_wan21_full_resolution(frames, tail_frames):
    """A Wan 2.1 residual block's norm writing its conv's input behind two cached frames and,
    again, the frames that conv caches (ComfyUI 0.8's 4-frame chunks, 0.33's 2-frame slices)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 96, frames, 480, 832)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16))
    addend = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16))
    gamma = 1.0 + 0.5 * torch.randn(96, generator=gen, device="cuda")
    buf = _channels_last(torch.zeros((1, 96, frames + 2, 480, 832), device="cuda",
                                     dtype=torch.bfloat16))
    tail = _channels_last(torch.full((1, 96, tail_frames, 480, 832), float("nan"),
                                     device="cuda", dtype=torch.bfloat16))
    out = rms_norm_silu(x, gamma, None, addends=(addend,), out=buf[:, :, 2:], tail=tail)
    assert out is not None
    assert torch.equal(tail, buf[:, :, frames + 2 - tail_frames:])
    assert torch.equal(buf[:, :, :2], torch.zeros_like(buf[:, :, :2]))
    ref = rms_norm_silu_reference(x, gamma, None, addends=(addend,))
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("frames_out,h,w", [
    (4, 480, 832),  # Wan 2.1 full resolution, a 0.8-style chunk: 460M-element buffer
    (8, 720, 1296),  # a buffer of 8 x 288 x 720 x 1296 > 2**31 elements: int64 slot offsets
])
def test_cuda_stacked_conv_input_at_real_sizes(frames_out, h, w):
    """A residual block's norm writing a ``stacked_taps`` conv input behind two cached frames:
    every new frame in each slot it feeds, the frame tail for the next cache."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 96, frames_out, h, w)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16))
    gamma = 1.0 + 0.5 * torch.randn(96, generator=gen, device="cuda")
    stacked = torch.empty((frames_out, 288, h, w), device="cuda", dtype=torch.bfloat16,
                          memory_format=torch.channels_last).zero_()
    tail = _channels_last(torch.empty((1, 96, 2, h, w), device="cuda", dtype=torch.bfloat16))
    assert rms_norm_silu(x, gamma, None, stacked=stacked, stacked_first=2, tail=tail) is stacked
    ref = rms_norm_silu_reference(x, gamma, None)
    torch.testing.assert_close(tail, ref[:, :, -2:], rtol=2**-7, atol=1e-5)
    for k in range(3):  # new frame i is slot k of output frame i + 2 - k, where that exists
        lo, hi = max(0, k - 2), frames_out + k - 2
        got = stacked[lo + 2 - k:hi + 2 - k, 96 * k:96 * (k + 1)].permute(1, 0, 2, 3)
        torch.testing.assert_close(got, ref[0, :, lo:hi], rtol=2**-7, atol=1e-5)
    assert not stacked[:2, :96].any() and not stacked[:1, 96:192].any()  # the cached frames' slots


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype", [CUDA_CASES[0], CUDA_CASES[3], CUDA_CASES[4]])
def test_cuda_fast_silu_matches_reference(shape, dtype):
    """SiLU's MUFU form (``kernels.silu``) within the library form's tolerance of the
    reference, with inputs reaching far into SiLU's negative tail."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = _channels_last((3 * torch.randn(shape, generator=gen, device="cuda") - 2).to(dtype))
    channels, ndim = shape[1], len(shape)
    gamma = (4.0 * torch.randn(channels, generator=gen, device="cuda")).reshape(
        (channels,) + (1,) * (ndim - 2))
    bias = -2.0 + torch.randn_like(gamma)
    out = rms_norm_silu(x, gamma, bias, fast_silu=True)
    assert out is not None and torch.isfinite(out).all()
    ref = rms_norm_silu_reference(x, gamma, bias)
    rtol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)
