"""Shared pieces of the LTX VAE fused modules: static checks, the causal 3-D conv on
channels-last-3d tensors with ComfyUI's per-thread frame state, the residual exchange across
chunks, and depth-to-space.

The stock ``CausalConv3d`` builds its input with copies: the first (and, non-causal, last)
frame repeated in time, joined with ``torch.cat``, then ``nn.Conv3d`` pads space (``reflect``
in LTX decoders: another copy) and convolves in NCDHW. Here the conv input is one
channels-last-3d buffer written once (time padding, cached frames and reflected borders
included), convolved by cuDNN in channels-last-3d, its bias added by the pass that reads the
output next.

State (0.33's ``temporal_cache_state``, see ``comfyui.ltx_code``) is never written while a fast
path can still fail: each helper returns its result and a *commit*, a closure of plain dict
stores the module runs once everything has been computed, so a stock retry after an exception
finds the state as the stock path left it.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.nn.functional as F

from ...comfyui.ltx_code import CHUNKED, forward_reason, frames_rule
from ...comfyui.weights import bias_of
from ...video_ops import CL3D, add_parts, conv_weight, to_cl3d

Commit = Callable[[], None]
PAD_MODES = ("zeros", "reflect")


def no_commit() -> None:
    return None


def thread_key() -> int:
    """The key of ComfyUI's per-thread ``temporal_cache_state`` entries."""
    return threading.get_ident()


def chunked(module: torch.nn.Module) -> bool:
    """Whether ``module``'s stock code keeps frame state between chunks (checked at install)."""
    return frames_rule(module) == CHUNKED


# --- static structure (checked at install) ---------------------------------------------------


def causal_conv_static_reason(conv: torch.nn.Module) -> str | None:
    """Why ``causal_conv`` cannot stand in for the stock ``CausalConv3d`` ``conv``."""
    reason = forward_reason(conv)
    if reason is not None:
        return reason
    inner = getattr(conv, "conv", None)
    if not isinstance(inner, torch.nn.Conv3d):
        return "causal conv without an inner Conv3d"
    k = tuple(inner.kernel_size)
    if len(set(k)) != 1 or k[0] % 2 == 0 or getattr(conv, "time_kernel_size", None) != k[0]:
        return f"kernel {k}"
    if tuple(inner.stride) != (1, 1, 1) or getattr(conv, "time_stride", 1) != 1:
        return "strided conv"
    if tuple(inner.dilation) != (1, 1, 1) or inner.groups != 1:
        return "dilated or grouped conv"
    if tuple(inner.padding) != (0, k[1] // 2, k[2] // 2):
        return f"padding {tuple(inner.padding)}"
    if inner.padding_mode not in PAD_MODES:
        return f"padding mode {inner.padding_mode}"
    return None


# --- the causal conv -------------------------------------------------------------------------


def _assemble(x: torch.Tensor, front: torch.Tensor | None, n_front: int, n_back: int,
              pad_hw: tuple[int, int], reflect: bool) -> torch.Tensor:
    """The conv input: ``front`` frames (or ``n_front`` copies of x's first frame), x, and
    ``n_back`` copies of its last frame, in one channels-last-3d buffer; with ``reflect`` the
    spatial borders are filled by reflection (as ``padding_mode="reflect"``), otherwise the
    convolution's own zero padding is used. Returns x itself when nothing is added."""
    n_front = front.shape[2] if front is not None else n_front
    ph, pw = pad_hw if reflect else (0, 0)
    if not (n_front or n_back or ph or pw):
        return x
    b, c, t, h, w = x.shape
    buf = torch.empty((b, c, n_front + t + n_back, h + 2 * ph, w + 2 * pw), dtype=x.dtype,
                      device=x.device, memory_format=CL3D)
    inner = buf[:, :, :, ph:ph + h, pw:pw + w]
    if front is not None:
        inner[:, :, :n_front].copy_(front)
    elif n_front:
        inner[:, :, :n_front].copy_(x[:, :, :1].expand(-1, -1, n_front, -1, -1))
    inner[:, :, n_front:n_front + t].copy_(x)
    if n_back:
        inner[:, :, n_front + t:].copy_(x[:, :, -1:].expand(-1, -1, n_back, -1, -1))
    for i in range(1, ph + 1):  # rows first, then whole columns: corners reflect in both
        buf[:, :, :, ph - i, pw:pw + w].copy_(buf[:, :, :, ph + i, pw:pw + w])
        buf[:, :, :, ph + h - 1 + i, pw:pw + w].copy_(buf[:, :, :, ph + h - 1 - i, pw:pw + w])
    for j in range(1, pw + 1):
        buf[..., pw - j].copy_(buf[..., pw + j])
        buf[..., pw + w - 1 + j].copy_(buf[..., pw + w - 1 - j])
    return buf


def conv_frame_reason(conv: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Per call: reflect padding needs frames wider than the padding (stock raises otherwise)."""
    inner = conv.conv
    if inner.padding_mode == "reflect" and (x.shape[3] <= inner.padding[1] or x.shape[4] <= inner.padding[2]):
        return "frame too small for reflect padding"
    return None


def _conv_parts(inner: torch.nn.Conv3d, inp: torch.Tensor, pad_hw: tuple[int, int]) -> list[torch.Tensor]:
    """``inner``'s convolution of the assembled ``inp`` without its bias, as a list of
    channels-last-3d parts whose sum is the result (the form the folding consumers take).

    One cuDNN 3-D conv: unlike Wan's 96-channel convs (``wan.ops.TAPS_MAX_CHANNELS``), LTX's
    narrowest (128 channels, 34 frames of 130x194) measured faster as one channels-last-3d
    conv than as three per-tap 2-D convs on an H200 (0.89 vs 0.96 ms in bf16), as did 256-512.
    """
    out = F.conv3d(inp, conv_weight(inner, CL3D), None, 1, (0,) + pad_hw)
    return [to_cl3d(out)]


def causal_conv(conv: torch.nn.Module, x: torch.Tensor, causal: bool) -> tuple[list[torch.Tensor], Commit]:
    """The stock causal conv of channels-last-3d ``x``, as bias-free parts (see ``_conv_parts``;
    an empty list when the conv outputs no frames) and the commit of its frame state.

    The frames are the stock ones: without state, ``k - 1`` copies of the first frame in front
    (causal) or ``(k - 1) // 2`` in front and behind; with 0.33's state the frames cached by the
    previous chunk stand in front, the trailing copies come only with the last chunk, and the
    last ``k - 1`` frames of (front + x) are cached for the next chunk.
    """
    inner = conv.conv
    k = inner.kernel_size[0]
    half = (k - 1) // 2
    if chunked(conv):
        key = thread_key()
        cached, ended = conv.temporal_cache_state.get(key, (None, False))
    else:
        key, cached, ended = None, None, True
    if cached is None and x.shape[2] == 0:
        return [], no_commit  # the stock module returns an empty output and keeps no state
    n_front = 0 if cached is not None else (k - 1 if causal else half)
    n_back = half if (ended and not causal and x.shape[2] > 0) else 0
    commit = no_commit
    if key is not None:
        if ended:
            state = (None, True)
        else:
            state = (_last_frames(cached, x, n_front, k - 1), False)
        commit = lambda: conv.temporal_cache_state.__setitem__(key, state)  # noqa: E731
    pad_hw = (inner.padding[1], inner.padding[2])
    inp = _assemble(x, cached, n_front, n_back, pad_hw, inner.padding_mode == "reflect")
    if inp.shape[2] < k:
        return [], commit
    return _conv_parts(inner, inp, (0, 0) if inner.padding_mode == "reflect" else pad_hw), commit


def _last_frames(cached: torch.Tensor | None, x: torch.Tensor, n_front: int, count: int) -> torch.Tensor:
    """The last ``count`` frames of (``cached`` or ``n_front`` copies of x's first frame) + x,
    as a new tensor (the stock module keeps a view; a copy lets the input go)."""
    if count == 0:
        return x[:, :, :0]
    if x.shape[2] >= count:
        return x[:, :, -count:].clone(memory_format=CL3D)
    front = cached if cached is not None else x[:, :, :1].expand(-1, -1, n_front, -1, -1)
    return to_cl3d(torch.cat([front, x], dim=2)[:, :, -count:])


def conv_output(conv: torch.nn.Module, x: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts summed with the conv's bias (one pass), or the stock empty output."""
    if not parts:
        inner = conv.conv
        return torch.empty((x.shape[0], inner.out_channels, 0, x.shape[3], x.shape[4]),
                           dtype=x.dtype, device=x.device, memory_format=CL3D)
    return add_parts(parts, bias_of(conv.conv))


# --- the residual across chunks (0.33) -------------------------------------------------------


def exchange_add(out: torch.Tensor, bias: torch.Tensor | None, parts_rest: tuple,
                 cached: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out + parts_rest + bias`` plus the residual stream (``cached`` frames, then
    ``residual``) aligned frame by frame from the front; returns (sum, the residual frames past
    the output, which the next chunk adds). The stock ``add_exchange_cache`` contract."""
    t = out.shape[2]
    lead = 0 if cached is None else min(t, cached.shape[2])
    summed = add_parts([out, *parts_rest], bias, residual[:, :, :t] if lead == 0 else None)
    if lead:
        summed[:, :, :lead] += cached[:, :, :lead]
        summed[:, :, lead:] += residual[:, :, :t - lead]
    rest_cached = cached[:, :, lead:] if cached is not None else None
    rest = residual[:, :, t - lead:]
    if rest_cached is not None and rest_cached.shape[2]:
        rest = torch.cat([rest_cached, rest], dim=2)
    return summed, to_cl3d(rest.clone(memory_format=CL3D)) if rest.shape[2] else rest


# --- depth to space --------------------------------------------------------------------------


def depth_to_space(y: torch.Tensor, stride: tuple[int, int, int], residual: torch.Tensor | None = None,
                   repeat: int = 1) -> torch.Tensor:
    """``b (c p1 p2 p3) d h w -> b c (d p1) (h p2) (w p3)`` of channels-last-3d ``y`` into a new
    channels-last-3d tensor, in one pass; with ``residual`` (the block input, rearranged the
    same way and repeated ``repeat`` times over channels) added in the same pass."""
    y = to_cl3d(y)
    p1, p2, p3 = stride
    b, cy, d, h, w = y.shape
    c = cy // (p1 * p2 * p3)
    out = torch.empty((b, c, d * p1, h * p2, w * p3), dtype=y.dtype, device=y.device, memory_format=CL3D)
    # In memory a channels-last-3d tensor is (b, d, h, w, channels); the output's order is
    # (b, d, p1, h, p2, w, p3, c), so both sides are views and the pass is one strided copy.
    out_v = out.permute(0, 2, 3, 4, 1).view(b, d, p1, h, p2, w, p3, c)
    y_v = _spread(y, stride)
    if residual is None:
        out_v.copy_(y_v)
        return out
    r_v = _spread(to_cl3d(residual), stride).unsqueeze(-2)
    torch.add(y_v.unflatten(-1, (repeat, c // repeat)), r_v,
              out=out_v.unflatten(-1, (repeat, c // repeat)))
    return out


def _spread(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """Channels-last-3d ``x`` viewed as (b, d, p1, h, p2, w, p3, c) with channel c*P + offset."""
    p1, p2, p3 = stride
    b, cx, d, h, w = x.shape
    return (x.permute(0, 2, 3, 4, 1).view(b, d, h, w, cx // (p1 * p2 * p3), p1, p2, p3)
            .permute(0, 1, 5, 2, 6, 3, 7, 4))
