"""The LTX family's pieces against the stock formulas, without ComfyUI (tier 1, CPU).

The conv input (time padding by repeated frames, reflected spatial borders) and the causal conv
against ``cat`` + ``F.pad`` + ``conv3d``; depth-to-space (with the repeated residual) against
the reshape/permute it stands for; the residual exchange across chunks against its definition.
ComfyUI's own classes, chunked state included, are tier 2 (tests/comfyui/test_ltx_comfy.py).
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.families.ltx import ops
from fast_vae_decode.fastpath.families.ltx.modules import pixel_norm
from fast_vae_decode.fastpath.families.ltx.ops import (
    causal_conv,
    causal_conv_static_reason,
    conv_input,
    conv_output,
    depth_to_space,
    exchange_add,
)
from fast_vae_decode.kernels.rms_norm_silu import rms_norm_silu_reference

CL3D = torch.channels_last_3d


class _CausalConv(torch.nn.Module):
    """The shape of ComfyUI's ``CausalConv3d`` (an inner conv that pads space only); not its
    class, so it is taken as whole-input code."""

    def __init__(self, cin, cout, k=3, mode="reflect"):
        super().__init__()
        self.time_kernel_size = k
        self.conv = torch.nn.Conv3d(cin, cout, k, padding=(0, k // 2, k // 2), padding_mode=mode)


def _stock_conv(conv, x, causal):
    """The whole-input stock causal conv, from its definition."""
    k = conv.time_kernel_size
    if causal:
        x = torch.cat([x[:, :, :1].repeat(1, 1, k - 1, 1, 1), x], 2)
    else:
        h = (k - 1) // 2
        x = torch.cat([x[:, :, :1].repeat(1, 1, h, 1, 1), x, x[:, :, -1:].repeat(1, 1, h, 1, 1)], 2)
    return conv.conv(x)


def _cl3d(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).contiguous(memory_format=CL3D)


@pytest.mark.parametrize("mode", ["reflect", "zeros"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 4, 5, 6), (2, 3, 1, 3, 2)])
def test_causal_conv_matches_stock(mode, causal, shape):
    torch.manual_seed(0)
    conv = _CausalConv(shape[1], 5, mode=mode)
    x = _cl3d(shape)
    with torch.no_grad():
        parts, commit = causal_conv(conv, x, causal)
        got = conv_output(conv, x, parts)
        expected = _stock_conv(conv, x, causal)
    commit()  # whole-input code keeps no state
    assert got.shape == expected.shape and got.is_contiguous(memory_format=CL3D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_static_reasons():
    conv = _CausalConv(4, 4)
    assert "unrecognised" in causal_conv_static_reason(conv)  # not ComfyUI's code: not fused


@pytest.mark.parametrize("stride", [(2, 2, 2), (1, 2, 2), (2, 1, 1)])
@pytest.mark.parametrize("repeat", [None, 1, 4])
def test_depth_to_space_matches_rearrange(stride, repeat):
    p1, p2, p3 = stride
    n = p1 * p2 * p3
    c = 4 if repeat is None else 2 * repeat
    y = _cl3d((1, c * n, 2, 3, 2), seed=1)
    b, _, d, h, w = y.shape
    # b (c p1 p2 p3) d h w -> b c (d p1) (h p2) (w p3), channel index c * n + offset
    expected = (y.reshape(b, c, p1, p2, p3, d, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
                .reshape(b, c, d * p1, h * p2, w * p3))
    if repeat is None:
        got = depth_to_space(y, stride)
    else:
        x = _cl3d((1, (c // repeat) * n, 2, 3, 2), seed=2)
        xr = (x.reshape(b, c // repeat, p1, p2, p3, d, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
              .reshape(b, c // repeat, d * p1, h * p2, w * p3)).repeat(1, repeat, 1, 1, 1)
        expected = expected + xr
        got = depth_to_space(y, stride, x, repeat)
    assert got.is_contiguous(memory_format=CL3D)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cached_frames", [None, 0, 1, 3, 6])
def test_exchange_add_aligns_the_residual_stream(cached_frames):
    out = _cl3d((1, 4, 4, 2, 3), seed=3)
    residual = _cl3d((1, 4, 5, 2, 3), seed=4)
    cached = None if cached_frames is None else _cl3d((1, 4, cached_frames, 2, 3), seed=5)
    bias = torch.randn(4)
    stream = residual if cached is None else torch.cat([cached, residual], 2)
    expected = out + bias.reshape(1, -1, 1, 1, 1) + stream[:, :, :4]
    got, rest = exchange_add(out.clone(memory_format=CL3D), bias, (), cached, residual)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(rest, stream[:, :, 4:])


def test_exchange_add_sums_partial_outputs():
    parts = [_cl3d((1, 4, 3, 2, 2), seed=s) for s in (6, 7, 8)]
    residual = _cl3d((1, 4, 3, 2, 2), seed=9)
    expected = parts[0] + parts[1] + parts[2] + residual
    got, rest = exchange_add(parts[0].clone(memory_format=CL3D), None, tuple(parts[1:]), None, residual)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert rest.shape[2] == 0


def test_reflect_needs_frames_wider_than_the_padding():
    from fast_vae_decode.fastpath.families.ltx.ops import conv_frame_reason

    conv = _CausalConv(2, 2)
    assert conv_frame_reason(conv, torch.zeros(1, 2, 2, 1, 4)) is not None
    assert conv_frame_reason(conv, torch.zeros(1, 2, 2, 2, 2)) is None


def _normed(x, gamma, bias):
    return rms_norm_silu_reference(x, gamma, bias, 1e-6, silu=True, mean_eps=True)


# The norm writes its conv's input buffer (frames, reflected border) and the conv reads it: the
# same result as the norm, then the stock causal conv. Shapes: a 2-pixel-wide frame (the
# narrowest a reflected border takes), one frame (all time padding copies of it), batch 2.
@pytest.mark.parametrize("declined", [False, True])
@pytest.mark.parametrize("mode", ["reflect", "zeros"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 4, 5, 6), (2, 3, 1, 3, 2), (1, 16, 3, 2, 4)])
def test_norm_into_the_conv_input_matches_norm_then_conv(shape, causal, mode, declined, monkeypatch):
    if declined:  # the kernel refuses the target: the norm is copied in (and bordered) instead
        import fast_vae_decode.fastpath.families.ltx.modules as modules

        real = modules.rms_norm_silu
        monkeypatch.setattr(modules, "rms_norm_silu",
                            lambda *a, out=None, **kw: None if out is not None else real(*a, **kw))
    conv = _CausalConv(shape[1], 5, mode=mode)
    x = _cl3d(shape, seed=10)
    gamma, bias = 1 + 0.2 * torch.randn(shape[1]), 0.1 * torch.randn(shape[1])
    with torch.no_grad():
        inp = conv_input(conv, x, causal)
        h = pixel_norm(x, 1e-6, gamma, bias, silu=True, into=inp)
        parts, commit = inp.convolve()
        got = conv_output(conv, x, parts)
        expected = _stock_conv(conv, _normed(x, gamma, bias), causal)
    commit()
    torch.testing.assert_close(h, _normed(x, gamma, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("through_norm", [False, True])
@pytest.mark.parametrize("frames", [1, 3])
def test_cached_frames_stand_in_front_and_the_last_are_kept(frames, through_norm, monkeypatch):
    """0.33's chunk state: the frames cached by the previous chunk come first (their border
    reflected like the rest), and the last k - 1 frames of (cached + these) are committed."""
    monkeypatch.setattr(ops, "chunked", lambda module: True)
    conv = _CausalConv(4, 3)
    conv.temporal_cache_state = {}
    cached = _cl3d((1, 4, 2, 3, 5), seed=11)
    conv.temporal_cache_state[ops.thread_key()] = (cached, False)
    x = _cl3d((1, 4, frames, 3, 5), seed=12)
    gamma, bias = torch.ones(4), torch.zeros(4)
    with torch.no_grad():
        if through_norm:
            inp = conv_input(conv, x, True)
            frames_in = pixel_norm(x, 1e-6, gamma, bias, silu=True, into=inp)
            parts, commit = inp.convolve()
        else:
            frames_in = x
            parts, commit = causal_conv(conv, x, True)
        got = conv_output(conv, x, parts)
        whole = torch.cat([cached, frames_in], 2)
        expected = conv.conv(whole)
    assert conv.temporal_cache_state[ops.thread_key()][0] is cached  # nothing stored before commit
    commit()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    kept, ended = conv.temporal_cache_state[ops.thread_key()]
    assert not ended and torch.equal(kept, whole[:, :, -2:])
