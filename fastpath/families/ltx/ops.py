"""Shared pieces of the LTX VAE fused modules: static checks, the causal 3-D conv on
channels-last-3d tensors with ComfyUI's per-thread frame state, the residual exchange across
chunks, and depth-to-space.

The stock ``CausalConv3d`` builds its input with copies: the first (and, non-causal, last)
frame repeated in time, joined with ``torch.cat``, then ``nn.Conv3d`` pads space (``reflect``
in LTX decoders: another copy) and convolves in NCDHW. Here the conv input is one
channels-last-3d buffer (``ConvInput``: time padding, cached frames and reflected borders
included), convolved by cuDNN in channels-last-3d, its bias added by the pass that reads the
output next. In a resnet block the pixel norm writes the buffer's frames and borders itself,
so the norm's output is the conv's input: on an H200 that took the decode's copy kernels from
29.6 to 15.8 ms and LTX-2 768x512x121 ``high`` from 160.9 to 148.4 ms (0.33).

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

from ....kernels.rms_norm_silu import reflect_border_
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


class ConvInput:
    """One causal conv's input buffer, laid out before the frames it convolves exist.

    The buffer is channels-last-3d: the front frames (cached by the previous chunk, or copies
    of the first frame), the frames, the back frames (copies of the last), and with ``reflect``
    padding a border of ``border`` pixels around every frame. ``frames`` is the view the
    frames go into: a producer may write them there itself (the pixel norm does, border
    included), or ``take`` copies them in; ``convolve`` then adds the front and back frames
    and runs the conv. Without anything to add the buffer is the frames themselves.

    The frames and their padding are the stock ones: without state, ``k - 1`` copies of the
    first frame in front (causal) or ``(k - 1) // 2`` in front and behind; with 0.33's state
    the frames cached by the previous chunk stand in front, the trailing copies come only with
    the last chunk, and the last ``k - 1`` frames of (front + frames) are cached for the next
    chunk, in the commit ``convolve`` returns.
    """

    def __init__(self, conv: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, causal: bool):
        inner = conv.conv
        self.conv, self.k = conv, inner.kernel_size[0]
        half = (self.k - 1) // 2
        if chunked(conv):
            self.key = thread_key()
            self.cached, self.ended = conv.temporal_cache_state.get(self.key, (None, False))
        else:
            self.key, self.cached, self.ended = None, None, True
        b, c, t, h, w = shape
        # The stock module returns an empty output and keeps no state.
        self.empty = self.cached is None and t == 0
        self.n_front = self.cached.shape[2] if self.cached is not None else (self.k - 1 if causal else half)
        self.n_back = half if (self.ended and not causal and t > 0) else 0
        reflect = inner.padding_mode == "reflect"
        self.border = inner.padding[1] if reflect else 0  # square padding (static check)
        self.conv_padding = (0, 0, 0) if reflect else (0, inner.padding[1], inner.padding[2])
        self.shape, self.dtype, self.device = shape, dtype, device
        self.buf = self.frames = None
        self.bordered = False  # whether the frames' border is written (none to write: True)

    @property
    def trivial(self) -> bool:
        """Nothing to add around the frames: the conv reads them where they are."""
        return not (self.n_front or self.n_back or self.border)

    def target(self) -> torch.Tensor:
        """The view a producer writes the frames into (allocating the buffer)."""
        if self.frames is None:
            b, c, t, h, w = self.shape
            p = self.border
            self.buf = torch.empty((b, c, self.n_front + t + self.n_back, h + 2 * p, w + 2 * p),
                                   dtype=self.dtype, device=self.device, memory_format=CL3D)
            self.frames = self.buf[:, :, self.n_front:self.n_front + t, p:p + h, p:p + w]
        return self.frames

    def take(self, x: torch.Tensor) -> None:
        """The frames from ``x`` (where no producer wrote them into ``target()``)."""
        if self.trivial:
            self.buf = self.frames = x
        else:
            reflect_border_(self.target().copy_(x), self.border)
        self.bordered = True

    def written(self, bordered: bool) -> None:
        """A producer wrote ``target()`` (and the frames' border, if ``bordered``)."""
        if not bordered:
            reflect_border_(self.frames, self.border)
        self.bordered = True

    def _pad_time(self) -> None:
        n_front, t, p = self.n_front, self.frames.shape[2], self.border
        if self.cached is not None and n_front:
            front = self.buf[:, :, :n_front, p:self.buf.shape[3] - p, p:self.buf.shape[4] - p]
            reflect_border_(front.copy_(self.cached), p)
        elif n_front:  # whole bordered frames: the first one, repeated
            self.buf[:, :, :n_front].copy_(self.buf[:, :, n_front:n_front + 1].expand_as(self.buf[:, :, :n_front]))
        if self.n_back:
            last = n_front + t - 1
            self.buf[:, :, last + 1:].copy_(self.buf[:, :, last:last + 1].expand_as(self.buf[:, :, last + 1:]))

    def convolve(self) -> tuple[list[torch.Tensor], Commit]:
        """The conv of the buffer as bias-free parts (see ``_conv_parts``; an empty list when
        it outputs no frames) and the commit of the conv's frame state."""
        if self.empty:
            return [], no_commit
        assert self.bordered, "convolve before the frames were written"
        commit = no_commit
        if self.key is not None:
            if self.ended:
                state = (None, True)
            else:
                state = (_last_frames(self.cached, self.frames, self.n_front, self.k - 1), False)
            commit = lambda: self.conv.temporal_cache_state.__setitem__(self.key, state)  # noqa: E731
        self._pad_time()
        if self.buf.shape[2] < self.k:
            return [], commit
        return _conv_parts(self.conv.conv, self.buf, self.conv_padding), commit


def conv_frame_reason(conv: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Per call: reflect padding needs frames wider than the padding (stock raises otherwise)."""
    inner = conv.conv
    if inner.padding_mode == "reflect" and (x.shape[3] <= inner.padding[1] or x.shape[4] <= inner.padding[2]):
        return "frame too small for reflect padding"
    return None


def _conv_parts(inner: torch.nn.Conv3d, inp: torch.Tensor, padding: tuple[int, int, int]) -> list[torch.Tensor]:
    """``inner``'s convolution of the assembled ``inp`` without its bias, as a list of
    channels-last-3d parts whose sum is the result (the form the folding consumers take).

    One cuDNN 3-D conv: unlike Wan's 96-channel convs (``wan.ops.TAPS_MAX_CHANNELS``), LTX's
    narrowest (128 channels, 34 frames of 130x194) measured faster as one channels-last-3d
    conv than as three per-tap 2-D convs on an H200 (0.89 vs 0.96 ms in bf16), as did 256-512.
    """
    out = F.conv3d(inp, conv_weight(inner, CL3D), None, 1, padding)
    return [to_cl3d(out)]


def conv_input(conv: torch.nn.Module, x: torch.Tensor, causal: bool) -> ConvInput:
    """The input buffer of ``conv`` for frames shaped like ``x`` (see ``ConvInput``)."""
    return ConvInput(conv, tuple(x.shape), x.dtype, x.device, causal)


def causal_conv(conv: torch.nn.Module, x: torch.Tensor, causal: bool) -> tuple[list[torch.Tensor], Commit]:
    """The stock causal conv of channels-last-3d ``x``, as bias-free parts (see ``_conv_parts``;
    an empty list when the conv outputs no frames) and the commit of its frame state."""
    inp = conv_input(conv, x, causal)
    if not inp.empty:
        inp.take(x)
    return inp.convolve()


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
