"""Shared pieces of the Wan VAE fused modules: per-call checks, channels-last-3d helpers and
the causal 3-D convolution with its frame cache.

The Wan decoder runs one latent frame at a time. Every causal conv with a temporal kernel of 3
keeps the last ``CACHE_T`` frames of its input (``feat_cache[idx]``) and puts them in front of
the next chunk instead of zero padding. The helpers here reproduce that contract exactly, only
in channels-last-3d and without the separate ``torch.cat`` + ``F.pad`` copies of the stock
module (one buffer, spatial zero padding done by the convolution itself).

Everything a fused module reads directly (weights, biases) is checked per call: ComfyUI may
move, cast or patch weights between decodes (low-VRAM mode sets ``comfy_cast_weights`` and
casts inside the stock ``forward``; patches add ``weight_function``s).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....kernels.narrow_conv import NARROW_CONV as _NARROW_CONV_INPUT
from ....kernels.narrow_conv import narrow_conv, pack_narrow_conv_weight
from ....kernels.padded_grid_conv import TILINGS as _PADDED_GRID_SHAPES
from ....kernels.padded_grid_conv import empty_padded, padded_grid_conv, sweep_tiling, zero_border
from ....kernels.padded_grid_fill import padded_grid_fill
from ....kernels.rms_norm_silu import RMS_NORM_SILU, rms_norm_silu, rms_norm_silu_unsupported
from ....kernels.stacked_taps import (
    fill_stacked_,
    new_stacked_input,
    stacked_taps_conv,
    stacked_taps_weight,
)
from ...cache import cached
from ...comfyui.wan_code import JOINED, OWN, causal_padding, fingerprinted, method_code, stock_class
from ...comfyui.weights import bias_of, comfy_cast_reason, is_stable, weight_of
from ...conv_routes import NARROW_CONV, conv_route
from ...padded_grid import grid_device_ready, packed_grid_weight
from ...prewarm import frame_hint
from ...video_ops import CL3D, add_parts, conv_weight, sum_parts, to_cl3d
from .settings import settings

CACHE_T = 2  # frames each causal conv keeps from the previous chunk (the stock CACHE_T)


# --- checks --------------------------------------------------------------------------------


def norm_reason(norm: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Per-call: ``rms_norm_silu`` takes ``x`` once it is channels-last (the kernel's own check,
    less the layout: ``x`` is converted only in the fast path)."""
    reason = comfy_cast_reason(norm)
    if reason is not None:
        return reason
    return rms_norm_silu_unsupported(x, norm.gamma, norm.bias, layout=False)


def cache_entry_reason(feat_cache, feat_idx, count: int, markers: tuple = ()) -> str | None:
    """Per-call: the ``count`` cache slots a module will use hold tensors, nothing or ``markers``."""
    if feat_cache is None:
        return None
    if not isinstance(feat_cache, list) or not isinstance(feat_idx, list) or not feat_idx:
        return "frame cache is not a list"
    idx = feat_idx[0]
    if not isinstance(idx, int) or idx < 0 or idx + count > len(feat_cache):
        return "frame cache index out of range"
    for entry in feat_cache[idx:idx + count]:
        if entry is None or isinstance(entry, torch.Tensor):
            continue
        if not (isinstance(entry, str) and entry in markers):
            return f"frame cache holds a {type(entry).__name__}"
    return None


# --- static structure (checked at install) ---------------------------------------------------


def causal_conv_static_reason(conv: torch.nn.Module, kernel_t: int | tuple | None = None) -> str | None:
    """Why ``causal_conv3d`` cannot stand in for ``conv`` (a stock causal conv); ``kernel_t``:
    the temporal kernel(s) the caller takes. The time padding must be the causal one (all in
    front, kernel - 1 frames), the most frames a cache holds."""
    if not isinstance(conv, torch.nn.Conv3d):
        return f"conv is a {type(conv).__name__}, not a Conv3d"
    if fingerprinted(stock_class(conv)):
        code = method_code(conv, "forward")
        if isinstance(code, str):
            return code
    pad = causal_padding(conv)
    if isinstance(pad, str):
        return pad
    kt = conv.kernel_size[0]
    if kernel_t is not None and kt not in ((kernel_t,) if isinstance(kernel_t, int) else kernel_t):
        return f"temporal kernel {kt}"
    if pad[0] != kt - 1 or pad[0] > CACHE_T:
        return f"time padding {pad[0]} for a temporal kernel {kt}"
    if tuple(conv.stride) != (1, 1, 1) or tuple(conv.dilation) != (1, 1, 1):
        return "strided or dilated conv"
    return None


def pads(conv: torch.nn.Module) -> tuple[int, int, int]:
    """``(time, height, width)`` padding of a conv ``causal_conv_static_reason`` accepted."""
    pad = causal_padding(conv)
    if isinstance(pad, str):
        raise RuntimeError(pad)
    return pad


def cache_rule(module: torch.nn.Module) -> str:
    """What ``module``'s stock forward caches for its causal convs (``wan_code.JOINED``/``OWN``);
    diffusers' classes (not fingerprinted) cache the way ComfyUI 0.8 does."""
    code = method_code(module, "forward")
    return JOINED if isinstance(code, str) or code.cache is None else code.cache


def ignored_args(module: torch.nn.Module) -> tuple[str, ...]:
    """The parameters of ``module``'s stock forward that it never reads (a fused call may get them)."""
    code = method_code(module, "forward")
    return () if isinstance(code, str) else code.ignored


def forward_code_reason(module: torch.nn.Module) -> str | None:
    """Why the fused class may not stand in for ``module``: its stock forward (ComfyUI's classes
    only; diffusers' are taken as they are) is code this pack has not seen."""
    if not fingerprinted(stock_class(module)):
        return None
    code = method_code(module, "forward")
    return code if isinstance(code, str) else None


def rms_norm_static_reason(norm: torch.nn.Module) -> str | None:
    gamma = getattr(norm, "gamma", None)
    if not isinstance(gamma, torch.Tensor):
        return f"norm is a {type(norm).__name__} without gamma"
    if not getattr(norm, "channel_first", False):
        return "channel-last RMS norm"
    channels = gamma.shape[0]
    reason = RMS_NORM_SILU.channels_reason(channels)
    if reason is not None:
        return reason
    if abs(float(norm.scale) - channels**0.5) > 1e-6 * channels**0.5:
        return "RMS norm scale is not sqrt(channels)"
    bias = getattr(norm, "bias", None)
    if bias is not None and not isinstance(bias, (torch.Tensor, int, float)):
        return f"RMS norm bias is a {type(bias).__name__}"
    return None


# --- compute -------------------------------------------------------------------------------


def _fill_tail(tail: torch.Tensor | None, y: torch.Tensor) -> None:
    if tail is not None:
        tail.copy_(y[:, :, y.shape[2] - tail.shape[2]:])


def norm_silu(norm: torch.nn.Module, x: torch.Tensor, silu: bool = True, *,
              addends: tuple = (), in_bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, tail: torch.Tensor | None = None,
              stacked: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """RMS norm (+ SiLU) of channels-last ``x + sum(addends) + in_bias``, into ``out`` if given;
    ``tail`` (see ``cache_tail``) gets the result's last frames; ``stacked``: ``(buffer,
    first)``, a ``stacked_taps`` conv input that gets every frame in each slot it feeds
    (then returned instead of the result).

    Callers check ``norm_reason`` for ``x`` first, so the kernel declining plain ``x`` means the
    checks and the kernel disagree: raising sends the caller to its stock path (before any
    state changed). Declining only the folded inputs (a layout the kernel does not take) is
    handled here by summing them in torch first: slower, same math up to one rounding. A tail
    the kernel declines is copied from the result afterwards: the same bytes either way.
    """
    if stacked is not None:
        buffer, first = stacked
        y = rms_norm_silu(x, norm.gamma, norm.bias, silu=silu, addends=addends, in_bias=in_bias,
                          tail=tail, stacked=buffer, stacked_first=first,
                          fast_silu=settings.fast_silu)
        if y is not None:
            return y
        return fill_stacked_(buffer, norm_silu(norm, x, silu, addends=addends, in_bias=in_bias,
                                               tail=tail), first)
    kw = {"silu": silu, "addends": addends, "in_bias": in_bias, "out": out,
          "fast_silu": settings.fast_silu}
    y = rms_norm_silu(x, norm.gamma, norm.bias, **kw, tail=tail)
    if y is None and tail is not None:
        y = rms_norm_silu(x, norm.gamma, norm.bias, **kw)
        if y is not None:
            _fill_tail(tail, y)
    if y is not None:
        return y
    if addends or in_bias is not None:
        x = sum_parts([x.clone()] + list(addends), in_bias)
    y = rms_norm_silu(x, norm.gamma, norm.bias, silu=silu, fast_silu=settings.fast_silu)
    if y is None:
        raise RuntimeError("rms_norm_silu declined: "
                           + str(rms_norm_silu_unsupported(x, norm.gamma, norm.bias)))
    _fill_tail(tail, y)
    return y if out is None else out.copy_(y)


# Narrow 3x3x3 convs (Wan 2.1's 96 channels at full resolution) run faster on an H200 as three
# 2-D convs, one per temporal tap, over frame views of the same buffer (2.4 vs 3.2 ms for
# 96->96 at 480x832x4 in bf16); from 192 channels cuDNN's 3-D kernels win. Costs two extra
# roundings of the partial sums (the taps add in the activation dtype).
# Wider convs stay on cuDNN's 3-D kernels in 0.33's two-frame pieces too: running them as
# 2-D taps there to read the cached frames in place (``split_tap_parts``) gained nothing:
# Wan 2.1 x33 and Wan 2.2 704p within -1.3..+2.2% of this limit, interleaved on both trees
# (H200, docs/benchmark/f037ac7).
TAPS_MAX_CHANNELS = 128


def _plain_3x3x3(conv) -> bool:
    """A 3x3x3 conv without stride, dilation or groups: its taps are 2-D convs of frames."""
    return (tuple(conv.kernel_size) == (3, 3, 3) and tuple(conv.stride) == (1, 1, 1)
            and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1)


def taps_2d_shape(conv, shape: tuple[int, ...]) -> bool:
    """Whether a conv's input of ``shape`` is one the 2-D taps route takes on the GPU."""
    return shape[0] == 1 and shape[1] <= TAPS_MAX_CHANNELS and _plain_3x3x3(conv)


def _as_2d_taps(conv, inp: torch.Tensor) -> bool:
    return inp.is_cuda and taps_2d_shape(conv, inp.shape)


# A decode's first chunk meets each 3x3x3 conv with one frame and nothing cached, so only the
# last temporal tap applies: a 2-D conv. Up to this width cuDNN runs it faster as ``conv2d``
# over the frame than as a (1, 3, 3) ``conv3d`` (H200, torch 2.11, bf16, channels-last, median
# of 30; docs/benchmark/7c40816, kt1.log): 384 -> 384 at 120x208 0.139 vs 0.175 ms, 192 -> 384
# at 120x208 0.073 vs 0.102, 192 at 240x416 0.127 vs 0.149; Qwen-Image's 384 at 128² and 256²
# 0.098 vs 0.128 and 0.249 vs 0.418, 192 at 512² 0.291 vs 0.334. Not wider (Wan 2.2's 1024
# at 88x160: 0.409 vs 0.373; 512 -> 256 at 352x640: 0.780 vs 0.704), nor frames under 128²
# (384 at 60x104: 0.085 vs 0.070).
SINGLE_TAP_2D_MAX_CHANNELS = 384
SINGLE_TAP_2D_MIN_PIXELS = 128 * 128


def single_tap_2d_shape(conv, shape: tuple[int, ...]) -> bool:
    """Whether a conv's input of ``shape`` is one uncached frame that ``last_tap_part`` takes
    and the measurements above favour."""
    return (len(shape) == 5 and shape[0] == 1 and shape[2] == 1
            and shape[3] * shape[4] >= SINGLE_TAP_2D_MIN_PIXELS
            and max(conv.in_channels, conv.out_channels) <= SINGLE_TAP_2D_MAX_CHANNELS
            and _plain_3x3x3(conv))


def _single_tap_2d(conv, inp: torch.Tensor) -> bool:
    # cuDNN's kernels are what was measured: elsewhere the conv3d stays.
    return settings.single_frame_2d and inp.is_cuda and single_tap_2d_shape(conv, inp.shape)


def last_tap_part(conv, inp: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    """The 3x3x3 conv (no bias) of one uncached frame: its last temporal tap as a 2-D conv
    over the frame (a channels-last view), again a (1, C, 1, H, W) channels-last-3d tensor."""
    weight = weight_of(conv)
    tap = cached(conv, "last_tap_2d", (weight,), lambda: weight[:, :, -1].detach()
                 .contiguous(memory_format=torch.channels_last), keep=is_stable(conv))
    return to_cl3d(_as_video(F.conv2d(_frames(inp), tap, None, padding=(pad_h, pad_w))))


def conv_parts(conv, inp: torch.Tensor) -> list[torch.Tensor]:
    """The conv of the assembled input ``inp`` (see ``causal_input``) *without its bias*, as
    channels-last-3d tensors whose sum is the result: one, or two per-tap 2-D conv outputs.

    The caller adds the parts and the bias in the pass that reads them next (the following
    norm, or the residual add), instead of two ``+=`` passes and torch's separate bias pass.
    """
    _, pad_h, pad_w = pads(conv)
    short = conv.kernel_size[0] - inp.shape[2]  # > 0: the missing front frames are zeros
    narrow = narrow_parts(conv, inp, max(0, short), pad_h, pad_w)
    if narrow is not None:
        return narrow
    if _as_2d_taps(conv, inp):
        return tap_parts(conv, inp, pad_h, pad_w)
    if _single_tap_2d(conv, inp):  # one uncached frame: short == 2
        return [last_tap_part(conv, inp, pad_h, pad_w)]
    weight = conv_weight(conv, CL3D)
    if short > 0:  # as ComfyUI's autopad="causal_zero": only the taps that meet real frames
        full = weight_of(conv)
        weight = cached(conv, f"taps_from:{short}", (full,), lambda: full[:, :, short:]
                        .detach().contiguous(memory_format=CL3D), keep=is_stable(conv))
    out = F.conv3d(inp, weight, None, conv.stride, (0, pad_h, pad_w), conv.dilation, conv.groups)
    return [to_cl3d(out)]  # cuDNN keeps channels-last-3d; some CPU conv paths do not


def narrow_route(conv, first_tap: int) -> bool:
    """Whether ``conv_routes`` sends the conv (temporal taps from ``first_tap``) to
    ``narrow_conv`` (the input permitting)."""
    kernel = (conv.kernel_size[0] - first_tap, *conv.kernel_size[1:])
    return (conv_route(conv.out_channels, kernel) == NARROW_CONV
            and tuple(conv.stride) == (1, 1, 1) and tuple(conv.dilation) == (1, 1, 1)
            and conv.groups == 1)


def narrow_parts(conv, inp: torch.Tensor, first_tap: int, pad_h: int,
                 pad_w: int) -> list[torch.Tensor] | None:
    """The conv as one ``narrow_conv`` output (temporal taps from ``first_tap``), where
    ``conv_routes`` sends its shape there and the kernel takes ``inp``; else None (cuDNN)."""
    if not narrow_route(conv, first_tap) or _NARROW_CONV_INPUT.tensor_reason(inp) is not None:
        return None
    full = weight_of(conv)
    packed = cached(conv, f"narrow_conv:{first_tap}", (full,),
                    lambda: pack_narrow_conv_weight(full.detach()[:, :, first_tap:]),
                    keep=is_stable(conv))
    y = narrow_conv(inp, packed, (0, pad_h, pad_w))
    return None if y is None else [y]


def _tap_weights(conv) -> list[torch.Tensor]:
    """The 3x3x3 conv's three temporal taps as channels-last 2-D weights (a fold)."""
    weight = weight_of(conv)
    return cached(conv, "taps", (weight,), lambda: [
        weight[:, :, k].detach().contiguous(memory_format=torch.channels_last)
        for k in range(3)], keep=is_stable(conv))


def _frames(x: torch.Tensor) -> torch.Tensor:
    """(1, C, T, H, W) channels-last-3d as a channels-last batch of T frames: a view."""
    return x[0].permute(1, 0, 2, 3)


def _as_video(frames: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_frames``: again a (1, C, T, H, W) channels-last-3d view."""
    return frames.unsqueeze(0).permute(0, 2, 1, 3, 4)


def tap_parts(conv, inp: torch.Tensor, pad_h: int, pad_w: int) -> list[torch.Tensor]:
    """A batch-1 3x3x3 conv (no bias) as per-tap 2-D convs: ``inp[0]`` permuted to
    (T, C, H, W) is a channels-last batch of frames (a view), so each temporal tap is a 2-D
    conv over a frame slice of the same memory; each output is again a (1, C, T', H, W)
    channels-last-3d view. One part per tap that meets a real frame (``three_tap_parts``), or
    at most two with that setting off (the first two taps summed)."""
    frames = _frames(inp)
    first = max(0, 3 - frames.shape[0])  # taps before it meet only the implicit zero frames
    out_t = frames.shape[0] - 2 + first
    taps = _tap_weights(conv)
    parts = []
    for k in range(first, 3):
        parts.append(F.conv2d(frames[k - first:k - first + out_t], taps[k], None,
                              padding=(pad_h, pad_w)))
        if len(parts) == 2 and k < 2 and not settings.three_tap_parts:
            # Two tap outputs alive where ``three_tap_parts`` is off. Three once put the fast
            # path's peak one full-resolution activation above stock's (+146 MiB, Wan 2.1
            # 480p); later sessions lowered the fast path's peak, and now three fit under it.
            # The blocks reading their cached frames in place (``split_tap_parts``) hand three
            # parts too, with ``three_parts_in_pieces``.
            parts[0] += parts.pop()
    return [_as_video(p) for p in parts]


# 3x3x3 convs run as one 2-D conv over a channel-stacked input (``kernels.stacked_taps``,
# where ``settings.stacked_taps`` is set; off by default, see there): (channels in, out) -> the
# smallest frame where the conv alone measured faster that way. Per conv (H200,
# torch 2.11, bf16, median of 20, docs/benchmark/b28b6be, kt2-*.log), against cuDNN's
# conv3d: 384 at 120x208, 2 / 4 frames out, 0.593 / 1.080 vs 0.750 / 1.327 ms; 192 -> 384
# there 0.298 / 0.521 vs 0.332 / 0.638. Not 384 at 60x104 (1 frame: 0.218 vs 0.120), nor 192 at
# 240x416 (4 frames: 1.533 vs 1.303). Not Wan 2.1's 96 channels at 480x832 either, although
# the conv alone won there (4 frames: 1.710 vs 2.133 for the 2-D taps with their adds): the
# slots' extra bytes (each new frame written three times, the cached frames copied into three
# slots) took it back, and Wan 2.1 x33 ran 0.9% (0.8) and 4.6% (0.33) slower with it,
# interleaved (inter-stacked-*.log).
STACKED_TAPS_MIN_PIXELS = {(384, 384): 120 * 208, (192, 384): 120 * 208}


def stacked_taps_shape(conv, shape: tuple[int, ...], n_prev: int) -> bool:
    """Whether the conv over ``shape`` new frames behind ``n_prev`` cached ones is one of the
    measured stacked shapes (one uncached frame keeps its single-tap route)."""
    min_pixels = STACKED_TAPS_MIN_PIXELS.get((conv.in_channels, conv.out_channels))
    return (min_pixels is not None and len(shape) == 5 and shape[0] == 1 and _plain_3x3x3(conv)
            and (n_prev > 0 or shape[2] > 1)
            # a warm-up's small frames stand for the decode's (their kernel variants)
            and (shape[3] * shape[4] >= min_pixels or frame_hint() is not None))


def _stacked_taps(conv, x: torch.Tensor, n_prev: int) -> bool:
    # cuDNN's kernels are what was measured: elsewhere the other routes stay.
    return settings.stacked_taps and x.is_cuda and stacked_taps_shape(conv, tuple(x.shape), n_prev)


def stacked_input(conv, x: torch.Tensor, prev: torch.Tensor | None, keep: bool,
                  own: bool) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """``(buffer, first, cache)`` for a conv on the stacked route: its ``stacked_taps`` input
    with the causal zero frames and the cached frames ``prev`` in place, the sequence frame the
    new frames start at (the producer writes them, ``norm_silu(stacked=)``), and an empty
    tensor for the next cache (``cache_tail``'s rule; None unless ``keep``). None where the
    route does not take the conv (then ``causal_input`` or ``split_input_frames`` does)."""
    n_prev = prev.shape[2] if isinstance(prev, torch.Tensor) else 0
    pad_t, n_new = pads(conv)[0], x.shape[2]
    zeros = pad_t - n_prev
    if zeros < 0 or not _stacked_taps(conv, x, n_prev):
        return None
    total = pad_t + n_new
    cache = None
    if keep:
        start = max(zeros, total - CACHE_T)
        if own:
            start = max(start, total - n_new)
        if start < total - n_new or not settings.cache_from_norm:
            return None  # the next cache reaches into the cached frames: an assembled input
        shape = list(x.shape)
        shape[2] = total - start
        cache = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=CL3D)
    buffer = new_stacked_input(n_new, x.shape[1], x.shape[3], x.shape[4], x.dtype, x.device)
    if zeros:
        fill_stacked_(buffer, None, 0, zeros)
    if n_prev:
        fill_stacked_(buffer, prev, zeros)
    return buffer, zeros + n_prev, cache


def stacked_parts(conv, buffer: torch.Tensor) -> list[torch.Tensor]:
    """The conv (no bias) of its ``stacked_taps`` input: one part, as ``conv_parts``."""
    weight = weight_of(conv)
    folded = cached(conv, "stacked_taps", (weight,), lambda: stacked_taps_weight(weight.detach()),
                    keep=is_stable(conv))
    return [stacked_taps_conv(buffer, folded, *pads(conv)[1:])]


def split_input_frames(conv, x: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor | None:
    """An empty tensor shaped like ``x`` for the new frames of a causal conv that reads its
    cached frames ``prev`` where they lie (``split_tap_parts``), or None where the conv takes
    one assembled buffer (``causal_input``).

    Taken in the steady state of a decode loop at full resolution: the 2-D taps route (Wan
    2.1's 96 channels), ``CACHE_T`` cached frames in front of at least ``CACHE_T`` new ones
    (ComfyUI 0.33's ``run_up`` pieces of two; 0.8's chunks of four, with
    ``split_long_chunks``). No cached frame is copied into a buffer, and the next cache is the
    last ``CACHE_T`` new frames (of ``prev ++ x`` and of ``x`` alike): in a piece of two, the
    new frames themselves, so no tail is written either (``split_cache``).
    """
    n_new = x.shape[2]
    if (not settings.split_cached_frames or not isinstance(prev, torch.Tensor)
            or n_new < CACHE_T or (n_new > CACHE_T and not settings.split_long_chunks)
            or pads(conv)[0] != CACHE_T
            or prev.shape[2] != CACHE_T or prev.shape[:2] != x.shape[:2]
            or prev.shape[3:] != x.shape[3:] or prev.dtype != x.dtype or prev.device != x.device
            or not prev.is_contiguous(memory_format=CL3D)
            or not _as_2d_taps(conv, x) or narrow_route(conv, 0)):
        return None
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=CL3D)


def split_cache(new: torch.Tensor) -> torch.Tensor | None:
    """What the conv reading ``new`` behind its cached frames (``split_input_frames``) caches
    for the next chunk: ``new`` itself where it is ``CACHE_T`` frames; else an empty tensor
    for its last ``CACHE_T`` frames, which the norm writes as its tail (``cache_from_norm``),
    or None where that setting is off (the caller then clones them after the norm,
    ``next_cache``)."""
    if new.shape[2] == CACHE_T:
        return new
    if not settings.cache_from_norm:
        return None
    shape = (*new.shape[:2], CACHE_T, *new.shape[3:])
    return torch.empty(shape, dtype=new.dtype, device=new.device, memory_format=CL3D)


def _conv2d_into(out: torch.Tensor, frames: torch.Tensor, weight: torch.Tensor, pad_h: int,
                 pad_w: int) -> None:
    """A bias-free stride-1 2-D conv of the channels-last ``frames`` written into ``out``, a
    frame slice of a part: cuDNN writes there itself (its ``out=`` form takes the output's
    strides); without cuDNN (the CPU) the result is copied in."""
    cudnn = torch.backends.cudnn
    if out.is_cuda and cudnn.enabled and cudnn.is_available():
        torch.ops.aten.cudnn_convolution.out(
            frames, weight, [pad_h, pad_w], [1, 1], [1, 1], 1, cudnn.benchmark,
            cudnn.deterministic, cudnn.allow_tf32, out=out)
    else:
        out.copy_(F.conv2d(frames, weight, None, padding=(pad_h, pad_w)))


def split_tap_parts(conv, prev: torch.Tensor, new: torch.Tensor, pad_h: int,
                    pad_w: int) -> list[torch.Tensor]:
    """``tap_parts`` of the conv over ``prev ++ new`` (``CACHE_T`` cached frames and at least
    as many new ones, see ``split_input_frames``) without that buffer, each output frame the
    same sums.

    A piece of ``CACHE_T`` new frames gives two parts (tap 0 + tap 1, then tap 2): the middle
    tap reads one cached and one new frame, as two 1-frame convs added in; with
    ``three_parts_in_pieces``, as a longer chunk. A longer chunk gives one part per tap, as
    tap_parts does with ``three_tap_parts``: the runs of taps 0 and 1 each straddle the cached
    and the new frames, two convs written into one part by cuDNN's ``out=`` form (no copy of
    the cached frames, no add)."""
    taps, cached_frames, new_frames = _tap_weights(conv), _frames(prev), _frames(new)

    def tap(k: int, frames: torch.Tensor) -> torch.Tensor:
        return F.conv2d(frames, taps[k], None, padding=(pad_h, pad_w))

    n_new = new_frames.shape[0]
    if n_new == CACHE_T and not settings.three_parts_in_pieces:
        first = tap(0, cached_frames)
        first[:1] += tap(1, cached_frames[1:])
        first[1:] += tap(1, new_frames[:1])
        return [_as_video(first), _as_video(tap(2, new_frames))]
    height, width = new_frames.shape[2] + 2 * pad_h - 2, new_frames.shape[3] + 2 * pad_w - 2
    parts = []
    for k in range(CACHE_T):  # tap k's run: cached frames k.. and then the first new ones
        n_cached = CACHE_T - k
        part = torch.empty((n_new, taps[k].shape[0], height, width), dtype=new.dtype,
                           device=new.device, memory_format=torch.channels_last)
        _conv2d_into(part[:n_cached], cached_frames[k:], taps[k], pad_h, pad_w)
        if n_new > n_cached:
            _conv2d_into(part[n_cached:], new_frames[:n_new - n_cached], taps[k], pad_h, pad_w)
        parts.append(part)
    if not settings.three_tap_parts:
        parts[0] += parts.pop()
    parts.append(tap(2, new_frames))
    return [_as_video(p) for p in parts]


def causal_input(conv, x: torch.Tensor, prev: torch.Tensor | None,
                 writable: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The causal conv's input buffer for new frames shaped like ``x``: ``(buffer, view of its
    new frames, zero frames in front)``. Cached frames ``prev`` (used only when the conv pads
    time, the stock rule) are copied in behind the zero frames; the caller writes the new
    frames into the view (a producer kernel can write there directly: no extra copy).
    Spatial zero padding is the convolution's own ``padding``, which computes the same sums.

    A single new frame with nothing cached gets no zero frames at all: ``conv_parts`` then uses
    only the temporal taps that meet it (the sums of ComfyUI's ``autopad="causal_zero"``).
    Without time padding the buffer is ``x`` itself unless ``writable`` (the caller writes the
    new frames and still needs ``x``).
    """
    pad_t = pads(conv)[0]
    if pad_t == 0 or (prev is None and x.shape[2] == 1):
        if not writable:
            return x, x, 0
        inp = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=CL3D)
        return inp, inp, 0
    shape, zeros = _assembled_shape(x, prev, pad_t)
    inp = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=CL3D)
    return inp, _fill_front(inp, prev, zeros), zeros


def _assembled_shape(x: torch.Tensor, prev: torch.Tensor | None,
                     pad_t: int) -> tuple[tuple[int, ...], int]:
    """``(shape, zero frames)`` of an assembled input: the zero frames, the cached ``prev``
    (at most ``pad_t`` frames) and the new frames shaped like ``x``."""
    n_prev = prev.shape[2] if prev is not None else 0
    zeros = pad_t - n_prev
    if zeros < 0:
        raise RuntimeError(f"{n_prev} cached frames for a temporal padding of {pad_t}")
    shape = list(x.shape)
    shape[2] = zeros + n_prev + x.shape[2]
    return tuple(shape), zeros


def _fill_front(inp: torch.Tensor, prev: torch.Tensor | None, zeros: int) -> torch.Tensor:
    """Write the zero and cached frames in front of an assembled input ``inp``; returns the
    view of its new frames, which the producer writes."""
    n_prev = prev.shape[2] if prev is not None else 0
    if zeros:
        inp[:, :, :zeros].zero_()
    if n_prev:
        inp[:, :, zeros:zeros + n_prev].copy_(prev)
    return inp[:, :, zeros + n_prev:]


# --- the padded-grid route (``kernels.padded_grid_conv``, CUTLASS DSL on Hopper) -------------


def padded_grid_route(conv, x: torch.Tensor, prev: torch.Tensor | None) -> bool:
    """Whether a residual block's causal 3x3x3 conv of new frames ``x`` after ``prev`` takes
    ``padded_grid_conv``: where ``settings.padded_grid_conv`` is on, the DSL runs on ``x``'s
    device, the conv's widths are routed (``padded_grid_widths``), and the assembled input has
    at least three frames (a lone first frame keeps the routes above)."""
    if not settings.padded_grid_conv or not x.is_cuda or x.dtype != torch.bfloat16:
        return False  # before the conv's own checks: off the GPU nothing more is asked
    if x.dim() != 5 or x.shape[0] != 1 or not padded_grid_widths(conv):
        return False
    n_prev = prev.shape[2] if isinstance(prev, torch.Tensor) else 0
    if n_prev == 0 and x.shape[2] == 1:
        return False
    return grid_device_ready(x)


def padded_grid_widths(conv) -> bool:
    """Whether ``conv`` is a plain causal 3x3x3 conv whose channels the kernel has a measured
    tiling for and the route takes (``settings.padded_grid_min_channels``)."""
    if not _plain_3x3x3(conv) or pads(conv) != (CACHE_T, 1, 1):
        return False
    return ((conv.in_channels, conv.out_channels, 3) in _PADDED_GRID_SHAPES
            and conv.in_channels >= settings.padded_grid_min_channels)


def padded_causal_input(conv, x: torch.Tensor, prev: torch.Tensor | None):
    """``causal_input`` for the padded-grid route: ``(padded grid, its interior, view of the
    new frames, zero frames in front)``; the producer writes the new frames into the view.
    The border, zero frames and cached frames go in with one ``padded_grid_fill`` where
    ``settings.padded_grid_fill`` is on and it takes them, else with torch's fills and copy."""
    shape, zeros = _assembled_shape(x, prev, pads(conv)[0])
    fill = settings.padded_grid_fill
    padded, inp = empty_padded(shape, x.dtype, x.device, bordered=not fill)
    if fill:
        if padded_grid_fill(padded, prev, zeros):
            n_prev = prev.shape[2] if prev is not None else 0
            return padded, inp, inp[:, :, zeros + n_prev:], zeros
        zero_border(padded)
    return padded, inp, _fill_front(inp, prev, zeros), zeros


def padded_grid_parts(conv, padded: torch.Tensor,
                      residual: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """The conv of its padded grid as one part: without its bias, or given ``residual`` with
    its bias and ``residual`` added (the block's output); None where the kernel declines (the
    caller then convolves the grid's interior on cuDNN and adds them itself)."""
    packed = packed_grid_weight(conv, padded.dtype)
    if packed is None:
        return None
    source = bias_of(conv) if residual is not None else None
    bias = None if source is None else cached(
        conv, "padded_grid_bias", (source,), lambda: source.detach().float(),
        keep=is_stable(conv))
    tiling = None  # the measured tiling: the default asks nothing more of this per-conv path
    if settings.padded_grid_candidate >= 0:
        cout, kt, _, _, cin = packed.shape
        tiling = sweep_tiling(cin, cout, kt, settings.padded_grid_candidate)
    y = padded_grid_conv(padded, packed, bias, residual, ffi=settings.padded_grid_tvm_ffi,
                         tiling=tiling)
    return None if y is None else [y]


def next_cache(inp: torch.Tensor, zeros: int, new: int | None = None) -> torch.Tensor:
    """What the stock block caches for a conv: the last ``CACHE_T`` frames of ``prev ++ x``
    (``wan_code.JOINED``), which in the assembled input are the frames after the zero padding;
    given the number of ``new`` frames, of ``x`` alone (``wan_code.OWN``)."""
    return inp[:, :, _cache_start(inp, zeros, new):].clone(memory_format=CL3D)


def _cache_start(inp: torch.Tensor, zeros: int, new: int | None) -> int:
    """The first frame of ``inp`` that the next cache holds (``next_cache``'s rule)."""
    start = max(zeros, inp.shape[2] - CACHE_T)
    return start if new is None else max(start, inp.shape[2] - new)


def cache_tail(inp: torch.Tensor, zeros: int, new: torch.Tensor,
               own: bool = False) -> torch.Tensor | None:
    """An empty tensor for what ``next_cache`` would return, where that lies within the new
    frames ``new`` (the view of ``inp`` the producer writes): the producer then writes it too
    (``norm_silu``'s ``tail``) and no clone reads it back. None where the cache reaches into
    the cached frames in front (a single new frame under ``JOINED``) or the setting is off."""
    if not settings.cache_from_norm:
        return None
    total, n_new = inp.shape[2], new.shape[2]
    start = _cache_start(inp, zeros, n_new if own else None)
    if start < total - n_new:
        return None
    shape = list(new.shape)
    shape[2] = total - start
    return torch.empty(shape, dtype=new.dtype, device=new.device, memory_format=CL3D)


def norm_causal_conv(norm: torch.nn.Module, conv: torch.nn.Module, inputs: list[torch.Tensor],
                     prev: torch.Tensor | None, keep: bool, own: bool,
                     in_bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
    """A residual block's ``norm`` (+ SiLU) of ``sum(inputs) + in_bias`` and then its causal
    ``conv`` over the cached frames ``prev`` and that: ``(conv parts, next cache or None,
    finished)``; the next cache is what the stock block stores (``own``: ``wan_code.OWN``)
    where ``keep``. The parts are without the conv's bias unless ``finished``: given a
    ``residual`` (the block's input, an identity shortcut) the padded-grid route, where
    ``settings.padded_grid_residual`` is on, adds the bias and it in the conv's epilogue and
    returns the block's output as the one part.

    The norm writes straight into the conv's input: the interior of a zero-padded grid on the
    Hopper route (``padded_grid_route``), its own tensor where the conv reads the cached
    frames in place (``split_input_frames``), else behind them in an assembled buffer
    (``causal_input``), together with the frames the conv caches (``cache_tail``) where they
    are new ones. ``inputs`` is emptied once the norm has read it, so the caller's last
    reference to them goes before the conv allocates its outputs (peak memory).
    """
    x, addends = inputs[0], tuple(inputs[1:])
    padded = None
    if padded_grid_route(conv, x, prev):
        padded, inp, new, zeros = padded_causal_input(conv, x, prev)
    else:
        stacked = stacked_input(conv, x, prev, keep, own)
        if stacked is not None:
            buffer, first, cache = stacked
            norm_silu(norm, x, addends=addends, in_bias=in_bias, tail=cache,
                      stacked=(buffer, first))
            inputs.clear()
            del x, addends
            return stacked_parts(conv, buffer), cache, False
        new = split_input_frames(conv, x, prev)
        if new is not None:
            cache = split_cache(new) if keep else None
            norm_silu(norm, x, addends=addends, in_bias=in_bias, out=new,
                      tail=None if cache is new else cache)
            inputs.clear()
            del x, addends
            if keep and cache is None:
                cache = next_cache(new, 0)
            return split_tap_parts(conv, prev, new, *pads(conv)[1:]), cache, False
        inp, new, zeros = causal_input(conv, x, prev, writable=True)
    cache = cache_tail(inp, zeros, new, own) if keep else None
    norm_silu(norm, x, addends=addends, in_bias=in_bias, out=new, tail=cache)
    inputs.clear()
    del x, addends
    if keep and cache is None:
        cache = next_cache(inp, zeros, new.shape[2] if own else None)
    del new
    if padded is not None:
        finish = residual if settings.padded_grid_residual else None
        parts = padded_grid_parts(conv, padded, finish)
        if parts is not None:
            return parts, cache, finish is not None
    return conv_parts(conv, inp), cache, False


def causal_conv3d(conv: torch.nn.Module, x: torch.Tensor, prev: torch.Tensor | None,
                  keep_cache: bool = False, rule: str = JOINED) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stock causal conv applied to channels-last-3d ``x`` after the cached frames ``prev``.

    Returns ``(output, next cache)``; the next cache (only with ``keep_cache``) is what the
    stock block stores for this conv under its cache ``rule``: the last ``CACHE_T`` frames of
    ``prev ++ x`` (``JOINED``; just ``x`` when that is one frame and there is no ``prev``) or of
    ``x`` (``OWN``), as a new tensor. The stock module concatenates (and pads) with copies;
    here the input is assembled once (``causal_input``).
    """
    pad_t = pads(conv)[0]
    inp, new, zeros = causal_input(conv, x, prev if pad_t > 0 else None)
    if new is not x:
        new.copy_(x)
    cache = None
    if keep_cache:
        if rule == OWN:
            cache = x[:, :, -CACHE_T:].clone(memory_format=CL3D)
        elif pad_t > 0:
            cache = next_cache(inp, zeros)
        elif x.shape[2] < CACHE_T and prev is not None:
            cache = to_cl3d(torch.cat([prev[:, :, -1:].to(x.device), x], dim=2))
        else:
            cache = x[:, :, -CACHE_T:].clone(memory_format=CL3D)
    return add_parts(conv_parts(conv, inp), bias_of(conv)), cache
