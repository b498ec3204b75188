"""Fused ResnetBlock, AttnBlock and Upsample of the KL image VAEs (ComfyUI's and diffusers').

Each mixin is swapped onto a stock module (``swap.swap_in``); it reads the module's own
Parameters, so the state dict is unchanged, and the closed gate runs the stock ``forward``.
With the gate open a block works on channels-last tensors: it converts its input once (a
no-op inside the fused decoder, which feeds channels-last tensors) and hands back its output
in the input's layout family (``kl_ops.like_input``).

The ComfyUI and diffusers classes compute the same thing with different attribute names;
``_parts`` maps each to the same pieces, and the shared computation lives in the base mixins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....kernels.bias_residual_add import sum_biases
from ....kernels.exp_scores import exp_scores
from ....kernels.group_norm_silu import GROUP_NORM_SILU
from ....kernels.upsample_conv_fold import (
    fold_upsample_conv_weight,
    fold_upsample_conv_weight_subpixel,
    upsample_conv_folded,
    upsample_conv_subpixel,
)
from ....kernels.vae_attention import (
    attention_chunked,
    attention_exp_scores,
    attention_sdpa,
    exp_scores_attention_unsupported,
    fold_attention_weights,
    from_tokens,
    to_tokens,
)
from ...cache import cached
from ...comfyui.weights import bias_of, is_stable, weight_of
from ...fused import FusedModule
from ...prewarm import frame_hint
from ...reasons import input_reason
from .exp_scores_guard import exp_scores_guard
from .ops import (
    StockLayoutGuard,
    add_bias_residual_,
    conv2d,
    like_input,
    norm_silu_conv,
    to_channels_last,
    weights_reason,
)
from .settings import settings

# diffusers attention processors whose computation ``FusedAttention`` reproduces (single head,
# no mask, SDPA's default scale 1/sqrt(C)).
DIFFUSERS_ATTENTION_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")


def _extra_args_reason(args, kwargs) -> str | None:
    if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
        return "extra arguments"
    return None


def _dropout_reason(module: torch.nn.Module) -> str | None:
    dropout = getattr(module, "dropout", None)
    if module.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
        return "training-mode dropout"
    return None


# ---------------------------------------------------------------------------------------------
# ResnetBlock: norm1+SiLU -> conv1 -> norm2+SiLU -> (dropout) -> conv2, plus the shortcut.


class _FusedResnet(FusedModule, StockLayoutGuard):
    """Subclasses define ``_parts() -> (norm1, conv1, norm2, conv2, shortcut|None, out_scale)``."""

    def _parts(self):
        raise NotImplementedError

    def fast_unsupported(self, x, temb=None, *args, **kwargs) -> str | None:
        reason = (_extra_args_reason((temb,) + args, kwargs) or input_reason(x, GROUP_NORM_SILU)
                  or _dropout_reason(self))
        if reason is not None:
            return reason
        norm1, conv1, norm2, conv2, shortcut, _ = self._parts()
        modules = (norm1, conv1, norm2, conv2) + ((shortcut,) if shortcut is not None else ())
        return weights_reason(modules, x)

    def prewarm_channels(self):
        return self._parts()[0].num_channels

    def fast_forward(self, x, temb=None, *args, **kwargs):
        norm1, conv1, norm2, conv2, shortcut, out_scale = self._parts()
        xc = to_channels_last(x)
        # Conv biases are added by one channels-last pass each (torch's broadcast add after the
        # conv is a slow generic kernel on channels-last), and conv2's together with the residual.
        h = norm_silu_conv(norm1, conv1, xc)
        if settings.norm_input_bias:
            out = norm_silu_conv(norm2, conv2, h, input_bias=bias_of(conv1))
        else:
            out = norm_silu_conv(norm2, conv2, add_bias_residual_(h, bias_of(conv1)))
        # The sum is the next block's norm input; changed after the add, nothing is handed on.
        groups = norm1.num_groups if out_scale == 1 else None
        if shortcut is None:
            add_bias_residual_(out, bias_of(conv2), xc, stats_groups=groups)
        else:
            sources = (bias_of(shortcut), bias_of(conv2))
            bias = cached(self, "resnet_shortcut_bias", sources, lambda: sum_biases(*sources),
                          keep=is_stable(shortcut) and is_stable(conv2))
            add_bias_residual_(out, bias, conv2d(shortcut, xc, use_bias=False),
                               stats_groups=groups)
        if out_scale != 1:
            out /= out_scale
        return like_input(out, x)


class FusedComfyResnetBlock(_FusedResnet):
    """``comfy.ldm.modules.diffusionmodules.model.ResnetBlock`` (2-D)."""

    def _parts(self):
        shortcut = None
        if self.in_channels != self.out_channels:
            shortcut = self.conv_shortcut if self.use_conv_shortcut else self.nin_shortcut
        return self.norm1, self.conv1, self.norm2, self.conv2, shortcut, 1


class FusedDiffusersResnetBlock2D(_FusedResnet):
    """``diffusers.models.resnet.ResnetBlock2D`` with no time embedding and no resampling."""

    def _parts(self):
        return (self.norm1, self.conv1, self.norm2, self.conv2, self.conv_shortcut,
                self.output_scale_factor)


# ---------------------------------------------------------------------------------------------
# Single-head attention block: norm -> q, k, v -> attention -> proj_out, plus the residual.


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T) v over (N, L, C) tokens, scale already folded into q (``settings``)."""
    mode = settings.attention
    if mode == "auto":
        # The batch's tokens, not one image's: SD1.5 768x512 batch 4 (4 x 6144 tokens) ran
        # 3.6 / 8.2% faster chunked than on SDPA's memory-efficient kernel (H200, 0.33 / 0.8,
        # docs/benchmark/3cdeced/interleave.md).
        tokens = q.shape[0] * q.shape[1]
        mode = ("exp_scores" if settings.auto_exp_scores
                and tokens >= settings.exp_scores_min_tokens else
                "chunked" if tokens >= settings.chunked_min_tokens else "sdpa")
    if mode == "sdpa":
        return attention_sdpa(q, k, v)
    if mode == "exp_scores" and not exp_scores_guard.suspended:
        # A range trip is the decoder's to act on (``exp_scores_guard``); an input the kernel
        # does not take (not bf16) keeps the chunked softmax.
        if exp_scores_attention_unsupported(q, k, v) is None:
            return attention_exp_scores(q, k, v, exp_scores_guard.flag(q.device))
    return attention_chunked(q, k, v, fp32_scores=settings.attention_fp32_scores,
                             row_softmax=settings.row_softmax)


class _FusedAttention(FusedModule, StockLayoutGuard):
    """Subclasses define ``_parts() -> (norm, (wq, bq), (wk, bk), (wv, bv), (wo, bo), modules,
    out_scale)`` with ``modules`` the projection modules whose weights are read."""

    def _parts(self):
        raise NotImplementedError

    def _call_reason(self, args, kwargs) -> str | None:
        return _extra_args_reason(args, kwargs)

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        reason = self._call_reason(args, kwargs) or input_reason(x, GROUP_NORM_SILU)
        if reason is not None:
            return reason
        norm, *_, modules, _ = self._parts()
        return weights_reason((norm,) + tuple(modules), x)

    def prewarm_channels(self):
        return self._parts()[0].num_channels

    def _warms_exp_scores(self, dtype: torch.dtype) -> bool:
        if dtype != torch.bfloat16:
            return False
        if settings.attention == "exp_scores":
            return True
        # auto: only where the first decode's latent already reaches the threshold (a larger
        # batch of smaller images compiles it in its first decode instead).
        hint = frame_hint()
        return (settings.attention == "auto" and settings.auto_exp_scores
                and (hint is None or hint[0] * hint[1] >= settings.exp_scores_min_tokens))

    def prewarm_first(self) -> bool:
        # exp_scores is a tl.dot kernel: the longest compiles start first.
        return self._warms_exp_scores(torch.bfloat16)

    def prewarm(self, device, dtype):
        super().prewarm(device, dtype)
        if self._warms_exp_scores(dtype):
            # The tiny input takes SDPA; a 2048² decode takes exp_scores, whose first compile
            # would otherwise fall inside that decode. Sizes share the variant.
            tokens = torch.zeros(1, 16, self.prewarm_channels(), device=device, dtype=dtype)
            exp_scores(tokens, tokens, torch.zeros(1, 16, device=device))

    def fast_forward(self, x, *args, **kwargs):
        norm, q, k, v, o, modules, out_scale = self._parts()
        sources = (*q, *k, *v, *o)
        folded = cached(self, "attention_fold", sources, lambda: fold_attention_weights(*sources),
                        keep=all(is_stable(m) for m in modules))
        xc = to_channels_last(x)
        height, width = xc.shape[-2:]
        tokens = to_tokens(norm.norm_silu(xc, silu=False))  # a free view of channels-last
        query = F.linear(tokens, folded.query_weight, folded.query_bias)
        # Attention rows sum to 1, so the folded output bias can ride on the values (free in
        # the GEMM's epilogue) instead of costing a pass over the output.
        value = F.linear(tokens, folded.value_weight, folded.out_bias)
        out = from_tokens(attend(query, tokens, value), height, width)
        out += xc
        if out_scale != 1:
            out /= out_scale
        return like_input(out, x)


def _conv_pair(conv):
    return weight_of(conv), bias_of(conv)


class FusedComfyAttnBlock(_FusedAttention):
    """``comfy.ldm.modules.diffusionmodules.model.AttnBlock`` (2-D)."""

    def _parts(self):
        convs = (self.q, self.k, self.v, self.proj_out)
        return (self.norm, *(_conv_pair(c) for c in convs), convs, 1)


class FusedDiffusersAttention(_FusedAttention):
    """``diffusers.models.attention_processor.Attention`` as the VAE mid-block uses it."""

    def _call_reason(self, args, kwargs) -> str | None:
        # The mid-block passes temb=None; a mask or cross-attention states are not ours.
        if type(self.processor).__name__ not in DIFFUSERS_ATTENTION_PROCESSORS:
            return f"attention processor {type(self.processor).__name__}"
        return _extra_args_reason(args, kwargs)

    def _parts(self):
        linears = (self.to_q, self.to_k, self.to_v, self.to_out[0])
        return (self.group_norm, *(_conv_pair(m) for m in linears), linears,
                self.rescale_output_factor)


# ---------------------------------------------------------------------------------------------
# Upsample: nearest 2x then a 3x3 conv, folded into one low-resolution op.


class _FusedUpsample(FusedModule, StockLayoutGuard):
    """Subclasses define ``_conv()`` (the 3x3 conv after the nearest-2x upsample)."""

    def _conv(self):
        raise NotImplementedError

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        reason = _extra_args_reason(args, kwargs) or input_reason(x, GROUP_NORM_SILU)
        if reason is not None:
            return reason
        return weights_reason((self._conv(),), x)

    def prewarm_channels(self):
        return self._conv().in_channels

    def fast_forward(self, x, *args, **kwargs):
        conv = self._conv()
        xc = to_channels_last(x)
        mode = settings.upsample
        weight, bias, keep = weight_of(conv), bias_of(conv), is_stable(conv)
        if mode == "transposed":
            w = cached(self, "upsample_fold", (weight,),
                       lambda: fold_upsample_conv_weight(weight), keep=keep)
            out = add_bias_residual_(upsample_conv_folded(xc, w, None), bias)
        elif mode == "subpixel":
            w4, b4 = cached(self, "upsample_fold_subpixel", (weight, bias), lambda: (
                fold_upsample_conv_weight_subpixel(weight),
                None if bias is None else bias.repeat_interleave(4)), keep=keep)
            out = upsample_conv_subpixel(xc, w4, b4)
        else:
            out = conv2d(conv, F.interpolate(xc, scale_factor=2.0, mode="nearest"))
        return like_input(out, x)


class FusedComfyUpsample(_FusedUpsample):
    """``comfy.ldm.modules.diffusionmodules.model.Upsample`` (2-D, with its conv)."""

    def _conv(self):
        return self.conv


class FusedDiffusersUpsample2D(_FusedUpsample):
    """``diffusers.models.upsampling.Upsample2D`` (nearest 2x + 3x3 conv, no norm)."""

    def _conv(self):
        return self.conv if self.name == "conv" else self.Conv2d_0

    def fast_unsupported(self, x, output_size=None, *args, **kwargs) -> str | None:
        if output_size is not None:
            return "explicit output size"
        return super().fast_unsupported(x, *args, **kwargs)
