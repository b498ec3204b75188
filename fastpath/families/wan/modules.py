"""Fused modules of the Wan VAE decoder (ComfyUI ``comfy.ldm.wan.vae``/``vae2_2`` and diffusers
``AutoencoderKLWan``), installed by class swap (see ``families/wan.py``).

While the gate is open activations are channels-last-3d from the first fused module on. The
stock code left in between (the decoder's own loop, Wan 2.2's ``Up_ResidualBlock`` and
``DupUp3D`` shortcut) and the stock path of a fused module that falls back (``Resample``, the
residual block) only reshape, slice, concatenate and convolve, which work in any layout (the
tests run them on channels-last-3d inputs); the one stock computation that ``view``s its input
(ComfyUI's VAE attention) is behind ``FusedWanAttention``, which hands the stock path a
contiguous tensor.

The frame cache (``feat_cache``/``feat_idx``) is state that outlives one call: ``FusedModule``
re-runs the stock ``forward`` with the same arguments when ``fast_forward`` raises, which is
only right if the fast path has not touched the cache yet. So every ``fast_forward`` here reads
its cache slots, computes everything, and only then writes the new cache entries and advances
``feat_idx`` -- plain list stores that cannot fail. An exception anywhere before leaves the
cache as the stock path expects it. The price is that the replaced cache frames live until the
end of the module instead of being dropped just before each conv.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....kernels.bias_residual_add import sum_biases
from ....kernels.dup_up_3d import dup_up_3d, dup_up_3d_unsupported
from ....kernels.rms_norm_silu import RMS_NORM_SILU
from ....kernels.upsample_conv_fold import fold_upsample_conv_weight, upsample_conv_folded
from ....kernels.vae_attention import attention_chunked
from ...cache import cached
from ...comfyui.wan_code import JOINED, OWN
from ...comfyui.weights import bias_of, is_stable, weight_of
from ...conv_routes import CUDNN, conv_route
from ...fused import FusedModule
from ...prewarm import frame_hint
from ...reasons import first_reason, input_reason
from ...video_ops import CL3D, add_parts, conv_weight, conv_weights_reason, to_cl, to_cl3d
from .exact import ExactCausalConv3d, ExactRMSNorm
from .join_first import first_in_join, joining, split_first_frame, upsample_cache_args
from .ops import (
    cache_entry_reason,
    causal_conv3d,
    causal_input,
    conv_parts,
    norm_causal_conv,
    norm_reason,
    norm_silu,
    pads,
)
from .settings import settings


def _extra_reason(module, args, kwargs) -> str | None:
    """Arguments past the ones a fused module reads are taken only where the stock forward
    ignores them (``_fvd_ignored``, set at install from ``wan_code``: 0.33's ``final``)."""
    ignored = module._fvd_ignored
    if len(args) > len(ignored) or not set(kwargs) <= set(ignored):
        return "extra arguments"
    return None


def _call_reason(module, x, args, kwargs) -> str | None:
    """Per-call checks shared by the cache-carrying Wan modules: (x, feat_cache, feat_idx)."""
    return _extra_reason(module, args, kwargs) or input_reason(x, RMS_NORM_SILU, rank=5)


class FusedWanResidualBlock(FusedModule):
    """``RMS_norm, SiLU, CausalConv3d, RMS_norm, SiLU, Dropout, CausalConv3d`` + shortcut.

    Norm + SiLU is one ``rms_norm_silu`` pass; the convs run channels-last-3d with their frame
    cache (``causal_conv3d``); the shortcut is added in place into the second conv's output.
    ``_fvd_parts`` (set at install) names the parts in the block's own attribute layout:
    ComfyUI keeps them in ``residual`` (an ``nn.Sequential``), diffusers as named children.
    """

    _fvd_parts: str = "comfy"
    _fvd_cache_rule: str = JOINED  # what the stock block caches (``wan_code``), set at install
    _fvd_ignored: tuple = ()  # stock parameters it never reads, set at install

    def _parts(self):
        if self._fvd_parts == "comfy":
            r = self.residual
            return r[0], r[2], r[3], r[6], self.shortcut
        return self.norm1, self.conv1, self.norm2, self.conv2, self.conv_shortcut

    def fast_unsupported(self, x, feat_cache=None, feat_idx=None, *args, **kwargs) -> str | None:
        reason = _call_reason(self, x, args, kwargs)
        if reason is not None:
            return reason
        if self.training:
            return "training mode (dropout)"
        norm1, conv1, norm2, conv2, shortcut = self._parts()
        return first_reason(
            cache_entry_reason(feat_cache, feat_idx, 2),
            norm_reason(norm1, x),
            conv_weights_reason(conv1, x),
            conv_weights_reason(conv2, x),
            None if isinstance(shortcut, torch.nn.Identity) else conv_weights_reason(shortcut, x),
        )

    _fvd_prewarm_rank = 5

    def prewarm_channels(self):
        return self._parts()[0].gamma.shape[0]

    def prewarm(self, device, dtype):
        """A decode's first chunk (one frame), then two frames behind the one it cached, then
        two behind two, through a private frame cache: the kernel variants only cached calls
        meet get compiled too (the norms' frame tails; the norms folding in two tap parts and,
        where the conv reads two cached frames in place (``split_tap_parts``), one)."""
        cache, channels = [None, None], self.prewarm_channels()
        for frames in (1, 2, 2):
            x = to_cl3d(torch.randn(1, channels, frames, 8, 8, device=device, dtype=dtype))
            self.prewarm_call(x, cache, [0])

    def fast_forward(self, x, feat_cache=None, feat_idx=None, *_ignored, **_ignored_kw):
        norm1, conv1, norm2, conv2, shortcut = self._parts()
        keep = feat_cache is not None
        own = self._fvd_cache_rule == OWN
        idx = feat_idx[0] if keep else 0
        prev1, prev2 = (feat_cache[idx], feat_cache[idx + 1]) if keep else (None, None)

        # Each norm writes straight into its conv's input (``norm_causal_conv``); each conv's
        # bias and per-tap partial outputs are summed by the pass that reads them next: norm2,
        # then the residual add. The convs themselves are the stock sums.
        x = to_cl3d(x)
        identity = isinstance(shortcut, torch.nn.Identity)
        parts, cache1, _ = norm_causal_conv(norm1, conv1, [x], prev1, keep, own)
        parts, cache2, finished = norm_causal_conv(norm2, conv2, parts, prev2, keep, own,
                                                   in_bias=bias_of(conv1),
                                                   residual=x if identity else None)
        if finished:  # conv2's epilogue added its bias and x
            h = parts[0]
        elif identity:
            h = add_parts(parts, bias_of(conv2), x)
        else:
            sources = (bias_of(conv2), bias_of(shortcut))
            bias = cached(self, "shortcut_bias", sources, lambda: sum_biases(*sources),
                          keep=is_stable(conv2) and is_stable(shortcut))
            h = add_parts(parts, bias, conv_parts(shortcut, causal_input(shortcut, x, None)[0])[0])

        if keep:  # nothing below can fail: the cache changes only once the block has succeeded
            feat_cache[idx] = cache1
            feat_cache[idx + 1] = cache2
            feat_idx[0] = idx + 2
        return h


class FusedWanCausalConv3d(FusedModule, ExactCausalConv3d):
    """A ``CausalConv3d``: fused outside a fused block (decoder ``conv1``, head, ``time_conv``);
    its stock path, which every conv takes with the gate closed (lossless) and inside a
    block on the stock path, is ``ExactCausalConv3d`` (one copy fewer, bit-exact).

    ComfyUI's version takes its cache either as ``cache_x`` or as ``cache_list[cache_idx]``,
    which it clears (so the old frames can be freed early); diffusers' takes ``cache_x``.
    """

    def fast_unsupported(self, x, cache_x=None, cache_list=None, cache_idx=None, *args, **kwargs):
        if args or kwargs:
            return "extra arguments"
        reason = input_reason(x, RMS_NORM_SILU, rank=5)
        if reason is not None:
            return reason
        if cache_list is not None:
            reason = cache_entry_reason(cache_list, [cache_idx], 1)
            if reason is not None:
                return reason
            cache_x = cache_list[cache_idx]
        if cache_x is not None and (not isinstance(cache_x, torch.Tensor) or cache_x.dim() != 5):
            return "cache is not a 5-D tensor"
        if cache_x is not None and cache_x.shape[2] > pads(self)[0] > 0:
            return "more cached frames than the time padding"
        return conv_weights_reason(self, x)

    _fvd_prewarm_rank = 5

    def prewarm_channels(self):
        # Every causal conv launches Triton: a routed one (``conv_routes``: the head) its conv,
        # one left on cuDNN the pass that adds its bias (``add_parts``).
        return self.in_channels

    def prewarm_first(self):
        return conv_route(self.out_channels, tuple(self.kernel_size)) != CUDNN

    def prewarm(self, device, dtype):
        """A chunk of several frames (every temporal tap, the routed kernel) and the first
        chunk's single frame (its last tap only: cuDNN's taps, whose bias add it warms)."""
        for frames in (3, 1):
            x = torch.randn(1, self.in_channels, frames, 8, 8, device=device, dtype=dtype)
            self.prewarm_call(to_cl3d(x))

    def fast_forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if cache_list is not None:
            cache_x = cache_list[cache_idx]
        out, _ = causal_conv3d(self, to_cl3d(x), cache_x)
        if cache_list is not None:
            cache_list[cache_idx] = None  # the stock module's release, after the last failure point
        return out


class FusedRMSNorm(FusedModule, ExactRMSNorm):
    """A standalone ``RMS_norm`` (the decoder head's): ``rms_norm_silu``.

    Where the head's ``nn.SiLU`` after it carries ``SiLUAfterNorm`` (``_fvd_silu``, set at
    install), the kernel applies the SiLU too, in fp32 before the one rounding, and marks its
    output so that module passes it on: one elementwise pass over the head's full-resolution
    frames fewer (the stock SiLU: 1.3 ms of a Wan 2.1 480p x33 decode on the H200,
    docs/benchmark/7c40816, prof-c0.8-wan21-r1.log). Its stock path is ``ExactRMSNorm`` where
    the family confirmed the formula (``_fvd_exact`` set at install), else the stock forward.
    """

    _fvd_silu: bool = False

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return "input is not a 4-D or 5-D tensor"
        return first_reason(input_reason(x, RMS_NORM_SILU), norm_reason(self, x))

    _fvd_prewarm_rank = 5

    def prewarm_channels(self):
        return self.gamma.shape[0]

    def fast_forward(self, x):
        y = norm_silu(self, to_cl(x), silu=self._fvd_silu)
        if self._fvd_silu:
            mark_silu_applied(y)
        return y


# Marks a tensor the fused head norm wrote with its SiLU applied: an attribute of that tensor
# object alone (a view or a copy does not carry it), so a SiLU meets it only where the norm's
# fast path handed its own output straight on; a stock norm's output is never marked.
_SILU_APPLIED = "_fvd_silu_applied"


def mark_silu_applied(t: torch.Tensor) -> None:
    setattr(t, _SILU_APPLIED, True)


class SiLUAfterNorm:
    """The head's ``nn.SiLU`` after a ``FusedRMSNorm`` that applies it: passes on the tensor
    that norm marked (``mark_silu_applied``), and is the stock SiLU on anything else (the
    closed gate, a norm that fell back): never a SiLU applied twice or left out."""

    def forward(self, x):
        if getattr(x, _SILU_APPLIED, False):
            return x
        return super().forward(x)


class FusedWanDupUp3D(FusedModule):
    """Wan 2.2's duplicating up-shortcut (``DupUp3D``): ``dup_up_3d`` writes it channels-last-3d,
    so the block's ``x_main + shortcut`` after it is a dense add. Stateless (no frame cache):
    a fallback re-runs the stock forward on the same input."""

    def fast_unsupported(self, x, first_chunk=False, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        if not isinstance(x, torch.Tensor) or not isinstance(first_chunk, bool):
            return "input is not a tensor and a first_chunk flag"
        return dup_up_3d_unsupported(x, self.out_channels, self.factor_t, self.factor_s,
                                     self.factor_t - 1 if first_chunk else 0)

    _fvd_prewarm_rank = 5

    def prewarm_channels(self):
        return self.in_channels

    def prewarm_key(self):
        # No parameters to tell shortcuts apart: the kernel variant follows these (constexprs).
        return type(self), self.in_channels, self.out_channels, self.factor_t, self.factor_s

    def fast_forward(self, x, first_chunk=False):
        out = dup_up_3d(x, self.out_channels, self.factor_t, self.factor_s,
                        self.factor_t - 1 if first_chunk else 0)
        if out is None:
            raise RuntimeError("dup_up_3d declined an input its checks accepted")
        return out


class FusedWanAttention(FusedModule):
    """The decoder's single-head spatial attention block, per frame, channels-last.

    ComfyUI's stock attention ``view``s q/k/v, which fails on the channels-last tensors the
    fast path produces, so the stock path (gate closed, or a fallback) always gets a contiguous
    input: ``contiguous()`` returns the tensor itself when it already is, so the closed-gate
    path is exactly stock.
    """

    _fvd_ignored: tuple = ()  # stock parameters it never reads (0.33's cache arguments)

    def forward(self, x, *args, **kwargs):
        return super().forward(x.contiguous() if isinstance(x, torch.Tensor) else x, *args, **kwargs)

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        reason = _extra_reason(self, args, kwargs) or input_reason(x, RMS_NORM_SILU, rank=5)
        if reason is not None:
            return reason
        return first_reason(norm_reason(self.norm, x), conv_weights_reason(self.to_qkv, x),
                            conv_weights_reason(self.proj, x))

    _fvd_prewarm_rank = 5

    def prewarm_channels(self):
        return self.norm.gamma.shape[0]

    def prewarm(self, device, dtype):
        """On a frame of the size the decode's attention meets (``frame_hint``: the mid-block
        runs at the latent's size), not a tiny one: the row softmax's tile is the frame's token
        count rounded up to a power of two, a kernel variant per size class."""
        height, width = frame_hint() or (8, 8)
        self.prewarm_call(to_cl3d(torch.randn(1, self.prewarm_channels(), 1, height, width,
                                              device=device, dtype=dtype)))

    def fast_forward(self, x, *_ignored, **_ignored_kw):
        b, c, t, h, w = x.shape
        identity = to_cl3d(x)
        # (b, c, t, h, w) channels-last-3d is (b, t, h, w, c) in memory: frames as a
        # channels-last image batch is a view.
        frames = identity.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        y = norm_silu(self.norm, to_cl(frames), silu=False)
        qkv = F.conv2d(y, conv_weight(self.to_qkv, torch.channels_last), bias_of(self.to_qkv))
        qkv = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c)
        q, k, v = qkv.split(c, dim=-1)
        mode = settings.attention
        if mode == "auto":
            mode = "chunked" if h * w < settings.chunked_max_tokens else "sdpa"
        if mode == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(c): the stock attention's
        else:
            # Strided (L, c) views of qkv go to the GEMMs as they are (row stride 3c).
            o = attention_chunked(q.squeeze(1), k.squeeze(1), v.squeeze(1), scale=c ** -0.5,
                                  budget_bytes=settings.attention_budget_bytes)
        o = o.reshape(b * t, h, w, c).permute(0, 3, 1, 2)  # channels-last view
        o = F.conv2d(o, conv_weight(self.proj, torch.channels_last), bias_of(self.proj))
        o = to_cl(o).reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return o + identity


class FusedWanResample(FusedModule):
    """The decoder's ``upsample2d``/``upsample3d`` ``Resample`` (ComfyUI) / ``WanResample``.

    ``upsample3d`` first doubles the frames: its ``time_conv`` makes 2C channels per frame and
    the two halves become consecutive frames. The first chunk of a decode skips that (the
    cache slot is set to the marker ``"Rep"``); the next one convolves without cached frames;
    later ones with them. Here the two halves are written straight into a channels-last-3d
    buffer (one copy; stock reshapes, stacks and rearranges), and nearest-2x + 3x3 conv run as
    one stride-2 4x4 transposed conv on the low-resolution frames (``upsample_conv_fold``):
    4 multiply-adds per output instead of 9, and no upsampled copy.
    """

    _fvd_cache_rule: str = JOINED  # what the stock module caches for its time conv (``wan_code``)
    _fvd_ignored: tuple = ()
    _fvd_splits_first_frame = True  # ``join_first.join_reason`` asks

    def forward(self, x, *args, **kwargs):
        # A joined first call (``join_first``): the first frame and the rest as the stock
        # loop's first and second calls, each then fused or stock as its own checks say.
        if self.mode == "upsample3d" and joining():
            feat_cache, feat_idx = upsample_cache_args(args, kwargs)
            if first_in_join(x, feat_cache, feat_idx):
                return split_first_frame(super().forward, x, feat_idx, *args, **kwargs)
        return super().forward(x, *args, **kwargs)

    def _conv(self):
        return self.resample[1]

    def fast_unsupported(self, x, feat_cache=None, feat_idx=None, *args, **kwargs) -> str | None:
        reason = _call_reason(self, x, args, kwargs) or conv_weights_reason(self._conv(), x)
        if reason is not None or self.mode == "upsample2d" or feat_cache is None:
            return reason
        return first_reason(cache_entry_reason(feat_cache, feat_idx, 1, markers=("Rep",)),
                            conv_weights_reason(self.time_conv, x))

    def fast_forward(self, x, feat_cache=None, feat_idx=None, *_ignored, **_ignored_kw):
        x = to_cl3d(x)
        commit = None
        if self.mode == "upsample3d" and feat_cache is not None:
            idx = feat_idx[0]
            prev = feat_cache[idx]
            if prev is None:
                commit = (idx, "Rep")  # the first chunk keeps its single frame
            else:
                rep = isinstance(prev, str)
                y, cache = causal_conv3d(self.time_conv, x, None if rep else prev, keep_cache=True,
                                         rule=self._fvd_cache_rule)
                if rep and x.shape[2] < 2 and self._fvd_cache_rule == JOINED:
                    # that stock code stores a zero frame before the single one
                    cache = to_cl3d(torch.cat([torch.zeros_like(cache), cache], 2))
                x = _interleave_halves(y)
                commit = (idx, cache)
        out = self._upsample_conv(x)
        if commit is not None:  # only plain list stores from here on
            feat_cache[commit[0]] = commit[1]
            feat_idx[0] = commit[0] + 1
        return out

    def _upsample_conv(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        conv = self._conv()
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)  # channels-last view
        weight = weight_of(conv)
        folded = cached(conv, "upsample_fold", (weight,), lambda: fold_upsample_conv_weight(
            weight.detach()).contiguous(memory_format=torch.channels_last), keep=is_stable(conv))
        # The bias goes in afterwards in one channels-last pass: given to conv_transpose2d,
        # torch adds it with a broadcast add_ that moved 1.3 TB/s on these outputs (H200,
        # Wan 2.2 704p: 18 ms per decode, 6 on Wan 2.1 480p), not a dense pass at memory speed.
        y = add_parts([to_cl(upsample_conv_folded(frames, folded, None))], bias_of(conv))
        return y.reshape(b, t, y.shape[1], 2 * h, 2 * w).permute(0, 2, 1, 3, 4)


def _interleave_halves(y: torch.Tensor) -> torch.Tensor:
    """(b, 2c, t, h, w) -> (b, c, 2t, h, w): channel half 0 to even frames, half 1 to odd."""
    b, c2, t, h, w = y.shape
    c = c2 // 2
    out = torch.empty((b, c, 2 * t, h, w), dtype=y.dtype, device=y.device, memory_format=CL3D)
    out[:, :, 0::2].copy_(y[:, :c])
    out[:, :, 1::2].copy_(y[:, c:])
    return out


__all__ = [
    "CL3D",
    "FusedRMSNorm",
    "SiLUAfterNorm",
    "FusedWanAttention",
    "FusedWanCausalConv3d",
    "FusedWanResample",
    "FusedWanResidualBlock",
]
