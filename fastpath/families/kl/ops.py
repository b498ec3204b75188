"""Shared pieces of the KL image-VAE fused modules: input and weight checks, channels-last
helpers, convs on a module's own weights, and ``FusedGroupNormSiLU`` for the norms.

Everything a fused block reads directly (weights, biases) is checked per call, because ComfyUI
may move, cast or patch weights between decodes: low-VRAM mode leaves them on the CPU and casts
them inside the stock ``forward`` (``comfy_cast_weights``), LoRA-style patches add
``weight_function``s. Any of those sends the module to its stock path.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

from ....kernels import group_norm_silu as _group_norm_silu
from ....kernels.bias_residual_add import bias_residual_add_
from ....kernels.group_norm_silu import (
    GroupStats,
    NormSiLU,
    add_bias_residual_group_stats_,
    group_norm_scale_shift,
    group_norm_silu,
    group_norm_silu_unsupported,
)
from ....kernels.group_norm_silu import out_reason as group_norm_out_reason
from ....kernels.narrow_conv import NARROW_CONV as _NARROW_CONV_INPUT
from ....kernels.narrow_conv import narrow_conv, narrow_conv_unsupported, pack_narrow_conv_weight
from ....kernels.padded_grid_conv import TILINGS as _PADDED_GRID_SHAPES
from ....kernels.padded_grid_conv import empty_padded, padded_grid_conv, sweep_tiling, zero_border
from ....kernels.padded_grid_fill import padded_grid_fill
from ....kernels.winograd_conv import winograd_conv, winograd_conv_unsupported, winograd_weight
from ...cache import cached
from ...comfyui.weights import bias_of, fetch_reason, is_stable, weight_of
from ...conv_routes import NARROW_CONV, conv_route
from ...fused import FusedModule
from ...padded_grid import grid_device_ready, packed_grid_weight
from ...reasons import AUTOGRAD as _AUTOGRAD
from ...video_ops import conv_weight
from .settings import settings

CHANNELS_LAST = torch.channels_last


def is_channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=CHANNELS_LAST)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=CHANNELS_LAST)


def like_input(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` in ``x``'s layout family: channels-last stays, anything else becomes contiguous.

    A fused block called with a contiguous tensor (its parent decoder runs stock) hands back a
    contiguous one, so stock code after it (ComfyUI's attention ``view``s its input) still works.
    """
    if is_channels_last(x) and not x.is_contiguous():
        return out
    return out.contiguous()


def group_norm_static_reason(norm: torch.nn.Module) -> str | None:
    """Why ``group_norm_silu`` can never take ``norm`` (shape-only; checked at install): the
    kernel's declared channel rules. The per-call checks (device, dtype, layout) are left to
    the kernel's own function."""
    if not isinstance(norm, torch.nn.GroupNorm):
        return f"norm is a {type(norm).__name__}, not a GroupNorm"
    return _group_norm_silu.GROUP_NORM_SILU.channels_reason(norm.num_channels, norm.num_groups)


def conv_static_reason(conv: torch.nn.Module, kernel: int, padding: int) -> str | None:
    """Why a fused block cannot run ``conv`` itself through ``F.conv2d`` (checked at install)."""
    if not isinstance(conv, torch.nn.Conv2d):
        return f"conv is a {type(conv).__name__}, not a Conv2d"
    if tuple(conv.kernel_size) != (kernel, kernel):
        return f"conv kernel {tuple(conv.kernel_size)}"
    if (tuple(conv.stride) != (1, 1) or tuple(conv.dilation) != (1, 1) or conv.groups != 1
            or conv.padding_mode != "zeros" or conv.padding != (padding, padding)):
        return "conv stride/padding/dilation/groups differ from the KL VAE's"
    return None


def weights_reason(modules, x: torch.Tensor) -> str | None:
    """Per-call checks on the weights a fused block reads directly.

    Conv/linear weights must match the input dtype (``F.conv2d`` does not mix dtypes); norm
    weights may be any float dtype (the kernel computes in fp32). Parameters are read live
    from each module (ComfyUI's patcher may replace Parameter objects between decodes).
    """
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return _AUTOGRAD
    device, dtype = x.device, x.dtype
    for m in modules:
        reason = fetch_reason(m, x)
        if reason is not None:
            return reason
        norm = isinstance(m, torch.nn.GroupNorm)
        for name in m._parameters:
            p = weight_of(m, name)
            if p is None:
                continue
            if p.device != device:
                return f"weights on {p.device}, input on {device}"
            if p.dtype != dtype and (not norm or not p.is_floating_point()):
                return f"weights in {p.dtype}, input in {dtype}"
            if grad and p.requires_grad:
                return _AUTOGRAD
    return None


def conv2d(conv: torch.nn.Conv2d, x: torch.Tensor, bias: torch.Tensor | None = None,
           use_bias: bool = True) -> torch.Tensor:
    """``conv`` applied with its own weights (checked by ``weights_reason``), layout kept."""
    b = bias if bias is not None else (bias_of(conv) if use_bias else None)
    # A channels-last input gets the weight kept channels-last (once per weight version): with
    # the contiguous one PyTorch converts the weight on every call (34 copies per SDXL decode).
    weight = (conv_weight(conv, CHANNELS_LAST)
              if settings.channels_last_weights and is_channels_last(x) else weight_of(conv))
    return F.conv2d(x, weight, b, conv.stride, conv.padding, conv.dilation, conv.groups)


def _plain_conv(conv: torch.nn.Module) -> bool:
    """Stride 1, no dilation, no groups, zero padding: what the pack's own convs compute."""
    return (all(s == 1 for s in conv.stride) and all(d == 1 for d in conv.dilation)
            and conv.groups == 1 and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str))


def resnet_conv(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A resnet block's conv without its bias (the next fused pass adds it): Winograd F(4x4,
    3x3) where ``settings.winograd_min_channels`` asks for it and the kernel takes ``x``
    (``kernels.winograd_conv``), cuDNN otherwise."""
    wide = settings.winograd_min_channels
    if (wide and conv.in_channels >= wide and _plain_conv(conv)
            and tuple(conv.kernel_size) == (3, 3) and tuple(conv.padding) == (1, 1)
            and winograd_conv_unsupported(x) is None):
        weight = weight_of(conv)
        # [36, Cin, Cout] fp16 per weight version: 4x the 3x3 weight's elements, kept like the
        # channels-last weights (dropped on unload, refetched under dynamic VRAM).
        u = cached(conv, "winograd_weight", (weight,), lambda: winograd_weight(weight.detach()),
                   keep=is_stable(conv))
        return winograd_conv(x, u)
    return conv2d(conv, x, use_bias=False)


def grid_conv_route(conv: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether a resnet conv of channels-last ``x`` runs on ``padded_grid_conv``: where
    ``settings.padded_grid_conv`` is on, the conv is a plain 3x3 of a measured tiling, the
    batch has ``settings.padded_grid_min_pixels`` pixels, and the DSL runs on x's device."""
    if (not settings.padded_grid_conv or not _plain_conv(conv)
            or tuple(conv.kernel_size) != (3, 3) or tuple(conv.padding) != (1, 1)
            or (conv.in_channels, conv.out_channels, 1) not in _PADDED_GRID_SHAPES):
        return False
    n, _, h, w = x.shape
    return n * h * w >= settings.padded_grid_min_pixels and grid_device_ready(x)


def norm_silu_conv(norm: FusedGroupNormSiLU, conv: torch.nn.Conv2d, x: torch.Tensor,
                   input_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``conv(silu(norm(x + input_bias)))`` without the conv's bias (the next fused pass adds
    it), channels-last. On the padded-grid route (``grid_conv_route``) the norm writes the
    interior of a zero-bordered grid whose frames are the batch's images, and the DSL conv
    reads it in place; otherwise the norm kernel, then ``resnet_conv``."""
    if grid_conv_route(conv, x):
        packed = packed_grid_weight(conv, x.dtype)
        if packed is not None:
            n, c, h, w = x.shape
            padded, interior = empty_padded((1, c, n, h, w), x.dtype, x.device, bordered=False)
            if not padded_grid_fill(padded, None, 0):
                zero_border(padded)
            normed = norm.norm_silu(x, input_bias=input_bias,
                                    out=interior[0].permute(1, 0, 2, 3))
            y = padded_grid_conv(padded, packed, tiling=sweep_tiling(
                c, conv.out_channels, 1, settings.padded_grid_candidate))
            if y is not None:
                return y[0].permute(1, 0, 2, 3)  # (N, Cout, H, W), dense channels-last
            return resnet_conv(conv, normed)
    return resnet_conv(conv, norm.norm_silu(x, input_bias=input_bias))


def _narrow_weight(conv: torch.nn.Module):
    """``conv``'s weight packed for ``narrow_conv``, once per weight version."""
    weight = weight_of(conv)
    return cached(conv, "narrow_conv", (weight,),
                  lambda: pack_narrow_conv_weight(weight.detach()), keep=is_stable(conv))


def routed_conv2d(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv`` with its bias on channels-last ``x``, on the op ``conv_routes`` picks for its
    shape; cuDNN (bias added in one channels-last pass) otherwise, or where that op declines."""
    if (_plain_conv(conv) and conv_route(conv.out_channels, tuple(conv.kernel_size)) == NARROW_CONV
            and _NARROW_CONV_INPUT.tensor_reason(x) is None):
        y = narrow_conv(x, _narrow_weight(conv), tuple(conv.padding), bias_of(conv))
        if y is not None:
            return y
    return add_bias_residual_(conv2d(conv, x, use_bias=False), bias_of(conv))


def norm_silu_head(norm: FusedGroupNormSiLU, conv: torch.nn.Conv2d,
                   x: torch.Tensor) -> torch.Tensor:
    """``conv(silu(norm(x)))`` with the conv's bias: a decoder's last norm and its head conv.

    Where ``settings.fused_head`` is on and ``narrow_conv`` takes the conv, the norm is its
    prologue: only the statistics pass reads x before the conv does, and the normalised
    activation is never written (``kernels.narrow_conv``'s note). Otherwise the norm kernel,
    then ``routed_conv2d``. Both convolve the same rounded activation."""
    if (settings.fused_head and _plain_conv(conv)
            and _NARROW_CONV_INPUT.tensor_reason(x) is None):
        packed = _narrow_weight(conv)
        padding, bias = tuple(conv.padding), bias_of(conv)
        # Asked before the statistics are taken: a decline leaves statistics a residual add
        # handed over for the norm kernel below.
        if narrow_conv_unsupported(x, packed, padding, bias) is None:
            y = narrow_conv(x, packed, padding, bias, prologue=norm.scale_shift(x),
                            fast_silu=settings.fast_silu)
            if y is not None:
                return y
    return routed_conv2d(conv, norm.norm_silu(x))


_DECODE = threading.local()


@contextlib.contextmanager
def channels_last_decode() -> Iterator[None]:
    """Marks the fused decoder's channels-last run on this thread (see ``StockLayoutGuard``)."""
    previous = getattr(_DECODE, "active", False)
    _DECODE.active = True
    _DECODE.handed = None
    try:
        yield
    finally:
        _DECODE.active = previous
        _DECODE.handed = None


# A residual add's statistics handed to the next norm (``settings.residual_norm_stats``): at
# most one tensor's, on this thread, within one fused decode. Invariant: they are used only by
# a norm of that very tensor object, and anything that could have written it since clears them
# (a block on its stock path, any norm of another tensor); a block that changes its output
# after the add (``out_scale``) does not hand any. Inference tensors have no version counter to
# check instead, and ComfyUI decodes under inference mode.
def hand_off_stats(out: torch.Tensor, stats: GroupStats | None) -> None:
    if getattr(_DECODE, "active", False):
        _DECODE.handed = None if stats is None else (out, stats)


def take_handed_stats(x: torch.Tensor) -> GroupStats | None:
    handed = getattr(_DECODE, "handed", None)
    _DECODE.handed = None
    return handed[1] if handed is not None and handed[0] is x else None


class StockLayoutGuard:
    """Keeps a fused block's stock path on the layout stock code expects.

    Sits between ``FusedModule`` and the stock class in the swapped class's MRO, so it wraps
    exactly the stock ``forward`` that ``FusedModule`` falls back to. Inside the fused decoder's
    channels-last run, a block that declines gets a contiguous input, as in a stock decode, and
    its output goes back to channels-last for the next block. Anywhere else (gate closed, or a
    stock decoder around the block) it passes the call straight through, so a decode whose
    fast path is unavailable is the stock computation bit for bit.
    """

    def forward(self, x, *args, **kwargs):
        _DECODE.handed = None  # a stock path could write anything (see ``hand_off_stats``)
        if (not getattr(_DECODE, "active", False) or not isinstance(x, torch.Tensor)
                or x.is_contiguous() or not is_channels_last(x)):
            return super().forward(x, *args, **kwargs)
        out = super().forward(x.contiguous(), *args, **kwargs)
        return to_channels_last(out) if isinstance(out, torch.Tensor) and out.dim() == 4 else out


def add_bias_residual_(out: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor | None = None,
                       stats_groups: int | None = None) -> torch.Tensor:
    """``out += bias (+ residual)`` in place: one pass through the kernel when it takes the
    tensors, torch's broadcast adds otherwise. ``out`` must be a fresh tensor (a conv output).

    ``stats_groups``: the add also takes ``out``'s statistics in that many groups and hands
    them to the next norm (``hand_off_stats``), where ``settings.residual_norm_stats`` is on
    and the kernel takes the tensors."""
    if stats_groups is not None and settings.residual_norm_stats and (bias is not None
                                                                      or residual is not None):
        stats = add_bias_residual_group_stats_(out, bias, residual, stats_groups,
                                               prefetch=settings.group_norm_prefetch)
        if stats is not None:
            hand_off_stats(out, stats)
            return out
    if (bias is None and residual is None) or bias_residual_add_(out, bias, residual) is not None:
        return out
    if bias is not None:
        out += bias.reshape((1, -1) + (1,) * (out.dim() - 2))
    if residual is not None:
        out += residual
    return out


class FusedGroupNormSiLU(FusedModule):
    """A GroupNorm whose fused blocks call ``norm_silu`` (GroupNorm + SiLU in one kernel).

    Its own ``forward`` takes the kernel (without SiLU) only for channels-last 4-D inputs
    (stock blocks pass them on too: diffusers' attention returns a channels-last view); any
    other input runs the stock norm directly, without counting as a fallback, since the
    kernel was never meant for it.
    """

    def forward(self, x, *args, **kwargs):
        if (args or kwargs or not isinstance(x, torch.Tensor) or not is_channels_last(x)
                or x.is_contiguous()):
            return super(FusedModule, self).forward(x, *args, **kwargs)  # the stock GroupNorm
        return super().forward(x)

    def fast_unsupported(self, x) -> str | None:
        reason = fetch_reason(self, x)
        if reason is not None:
            return reason
        return group_norm_silu_unsupported(x, weight_of(self), bias_of(self), self.num_groups)

    def fast_forward(self, x):
        return self.norm_silu(x, silu=False)

    def scale_shift(self, x: torch.Tensor) -> NormSiLU:
        """The norm + SiLU of channels-last ``x`` folded to per-channel factors, for a consumer
        that applies them as it reads x (``norm_silu_head``); raises if the kernel declines,
        as ``norm_silu`` does."""
        weight, bias = weight_of(self), bias_of(self)
        folded = group_norm_scale_shift(x, weight, bias, self.num_groups, self.eps,
                                        stats=take_handed_stats(x),
                                        prefetch=settings.group_norm_prefetch)
        if folded is None:
            raise RuntimeError("group_norm_scale_shift declined: " + str(
                group_norm_silu_unsupported(x, weight, bias, self.num_groups)))
        return folded

    def norm_silu(self, x: torch.Tensor, silu: bool = True,
                  input_bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """GroupNorm (+ SiLU) of channels-last ``x`` (+ ``input_bias`` per channel, never added
        in memory) through the kernel, into ``out`` where given (``group_norm_silu``'s); raises
        if it declines.

        Callers check ``input_reason``/``weights_reason`` first, so a decline here is a
        mismatch between those checks and the kernel's; raising sends the calling block to its
        stock path (``FusedModule`` disables it for the session and logs the reason).
        """
        weight, bias = weight_of(self), bias_of(self)
        stats = take_handed_stats(x)
        y = group_norm_silu(x, weight, bias, self.num_groups, self.eps, silu=silu,
                            input_bias=input_bias, stats=stats,
                            prefetch=settings.group_norm_prefetch, fast_silu=settings.fast_silu,
                            out=out)
        if y is None:
            raise RuntimeError("group_norm_silu declined: " + str(
                group_norm_silu_unsupported(x, weight, bias, self.num_groups, input_bias)
                or group_norm_out_reason(out, x)))
        return y
