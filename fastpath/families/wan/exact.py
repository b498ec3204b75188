"""Bit-exact, cheaper stock paths for Wan's causal 3-D convs and RMS norms (what lossless runs).

Stock ``CausalConv3d.forward`` (ComfyUI ``comfy.ldm.wan.vae``, diffusers ``WanCausalConv3d``)
builds the conv input in two full copies: ``torch.cat([cache_x, x], 2)``, then ``F.pad`` for the
remaining causal frames and the spatial border (itself a fill of the whole output and a copy).
Here the same tensor -- same shape, same contiguous strides, same values, zeros where ``F.pad``
writes zeros -- is assembled in one buffer: the cached and new frames are copied into its
interior once and only the padding is zeroed. The conv is then the stock parent's ``forward``
on that tensor (ComfyUI's ``ops.Conv3d``, with its weight casting and patches, or
``nn.Conv3d``), so it computes what stock computes from an identical input: bit for bit.

Only the common case is taken: input and cache not channels-last, the cache in the input's
dtype, at most as many cached frames as the causal padding, no extra arguments. Anything else
(a channels-last tensor from an open gate's fallback, a cache in another dtype that
``torch.cat`` would promote) runs the stock ``forward`` itself.

ComfyUI 0.33+'s conv (``wan_code``: time padding only, the convolution pads space) already
builds its input with one ``torch.cat`` of the zero frames, the cache and the new frames, and
a single uncached frame skips the zeros altogether (``causal_zero``): there is nothing left to
save bit-exactly, so that conv always runs its stock ``forward``.
"""
from __future__ import annotations

import torch

from ....kernels.rms_norm_exact import rms_norm_exact, rms_norm_exact_reference
from ...comfyui.wan_code import stock_pads_in_two_copies
from ...swap import stock_class, swapped_stock_class


def _channels_innermost(t: torch.Tensor) -> bool:
    """Channels-last(-3d)-like strides: ``torch.cat``/``F.pad`` would then keep that layout and
    the conv would see another memory format than our contiguous buffer. Any other strides
    (contiguous, or the frames-major order the upsample's rearrange leaves) give a contiguous
    ``F.pad`` output, like the buffer: only values are copied from them."""
    return t.shape[1] > 1 and t.stride(1) == 1


def _padded_input(conv, x: torch.Tensor, cache_x: torch.Tensor | None) -> torch.Tensor | None:
    """``F.pad(torch.cat([cache_x, x], 2), padding)`` as stock forms it, or None if not common."""
    pad_w, pad_w2, pad_h, pad_h2, pad_t, pad_t2 = conv._padding
    if (pad_w, pad_h, pad_t2) != (pad_w2, pad_h2, 0) or x.dim() != 5 or _channels_innermost(x):
        return None
    n_prev = 0
    if cache_x is not None and pad_t > 0:
        if (not isinstance(cache_x, torch.Tensor) or cache_x.dtype != x.dtype
                or cache_x.dim() != 5 or _channels_innermost(cache_x)
                or cache_x.shape[:2] != x.shape[:2] or cache_x.shape[3:] != x.shape[3:]):
            return None
        n_prev = cache_x.shape[2]
    zeros_t = pad_t - n_prev
    if zeros_t < 0:  # stock would crop with a negative pad
        return None
    b, c, t, h, w = x.shape
    buf = torch.empty((b, c, zeros_t + n_prev + t, h + 2 * pad_h, w + 2 * pad_w),
                      dtype=x.dtype, device=x.device)
    if zeros_t:
        buf[:, :, :zeros_t].zero_()
    frames = buf[:, :, zeros_t:]
    if pad_h:
        frames[:, :, :, :pad_h].zero_()
        frames[:, :, :, -pad_h:].zero_()
    if pad_w:
        frames[:, :, :, pad_h:pad_h + h, :pad_w].zero_()
        frames[:, :, :, pad_h:pad_h + h, -pad_w:].zero_()
    inner = frames[:, :, :, pad_h:pad_h + h, pad_w:pad_w + w]
    if n_prev:
        inner[:, :, :n_prev].copy_(cache_x)
    inner[:, :, n_prev:].copy_(x)
    return buf


class ExactCausalConv3d:
    """Mixin for a stock causal conv: the one-buffer input when it applies, else stock."""

    def forward(self, x, cache_x=None, cache_list=None, cache_idx=None, *args, **kwargs):
        stock = swapped_stock_class(self)
        if (stock is None or args or kwargs or not isinstance(x, torch.Tensor)
                or not stock_pads_in_two_copies(self)  # nothing to save (ComfyUI 0.33+)
                or torch.compiler.is_compiling()):  # a trace must see the stock graph
            return self._stock_forward(x, cache_x, cache_list, cache_idx, *args, **kwargs)
        cached = cache_list[cache_idx] if cache_list is not None else cache_x
        if (isinstance(cached, torch.Tensor) and self._padding[4] > 0
                and cached.device != x.device):
            cached = cached.to(x.device)  # as stock does (ComfyUI may offload caches)
        buf = _padded_input(self, x, cached)
        del cached  # never hold the old frames longer than stock does (it frees them early)
        if buf is None:
            return self._stock_forward(x, cache_x, cache_list, cache_idx)
        if cache_list is not None:
            cache_list[cache_idx] = None  # stock releases the slot: its frames are in buf now
        return super(stock, self).forward(buf)

    def _stock_forward(self, x, cache_x, cache_list, cache_idx, *args, **kwargs):
        if cache_list is not None or cache_idx is not None:  # ComfyUI's signature
            return super().forward(x, cache_x, cache_list, cache_idx, *args, **kwargs)
        if cache_x is not None:
            return super().forward(x, cache_x, *args, **kwargs)
        return super().forward(x, *args, **kwargs)


# --- RMS norm --------------------------------------------------------------------------------
# ComfyUI's ``RMS_norm`` is a norm reduction and four elementwise passes (divide, scale, gamma,
# bias); ``kernels/rms_norm_exact.py`` does the four in one pass with stock's roundings. Which
# formula a stock class computes is checked by behaviour at install (``exact_norm_reason``):
# a newer ComfyUI that, say, normalizes in fp32 first simply keeps its own forward.

EXACT_NORM_PROBE = (1, 1, 8, 8)  # (N, T, H, W) of the install-time probe; C is the norm's


def exact_norm_reason(norm: torch.nn.Module) -> str | None:
    """None when ``norm``'s stock forward computes ``rms_norm_exact_reference`` bit for bit
    (checked on a seeded probe in fp32 and bf16, where the roundings differ by formula)."""
    gamma = getattr(norm, "gamma", None)
    if not isinstance(gamma, torch.Tensor) or not getattr(norm, "channel_first", False):
        return "not a channel-first RMS norm with gamma"
    bias = getattr(norm, "bias", None)
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"bias is a {type(bias).__name__}"
    stock = stock_class(norm)
    gen = torch.Generator().manual_seed(0)
    shape = (EXACT_NORM_PROBE[0], gamma.shape[0]) + EXACT_NORM_PROBE[1:]
    probe = (torch.randn(shape, generator=gen) * 3).to(gamma.device)
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16):
                x = probe.to(dtype)
                if not torch.equal(stock.forward(norm, x),
                                   rms_norm_exact_reference(x, gamma, bias, float(norm.scale))):
                    return f"stock RMS norm rounds differently in {dtype}"
    except Exception as exc:  # e.g. weights on a meta device: no exact path
        return f"RMS norm probe failed ({type(exc).__name__})"
    return None


class ExactRMSNorm:
    """Mixin for a stock RMS norm whose formula ``exact_norm_reason`` confirmed at install."""

    _fvd_exact: bool = False  # set at install once exact_norm_reason(module) is None

    def forward(self, x, *args, **kwargs):
        if (self._fvd_exact and not args and not kwargs and isinstance(x, torch.Tensor)
                and not torch.compiler.is_compiling()):  # a trace must see the stock graph
            y = rms_norm_exact(x, self.gamma, self.bias, float(self.scale))
            if y is not None:
                return y
        return super().forward(x, *args, **kwargs)
