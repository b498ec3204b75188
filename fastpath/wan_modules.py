"""Fused modules of the Wan VAE decoder (ComfyUI ``comfy.ldm.wan.vae``/``vae2_2`` and diffusers
``AutoencoderKLWan``), installed by class swap (see ``families/wan.py``).

While the gate is open activations are channels-last-3d from the first fused module on. The
stock modules left in between (``Resample``, Wan 2.2's ``DupUp3D`` shortcut, the decoder's own
loop) only reshape, slice, concatenate and convolve, which work in any layout (tests run them on
channels-last-3d inputs); the one stock computation that
``view``s its input (ComfyUI's VAE attention) is behind ``FusedWanAttention``, which hands the
stock path a contiguous tensor.

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

from .fused import FusedModule
from .wan_ops import (
    CL3D,
    cache_entry_reason,
    causal_conv3d,
    conv_weight,
    conv_weights_reason,
    first_reason,
    norm_reason,
    norm_silu,
    tensor_reason,
    to_cl,
    to_cl3d,
)


class FusedWanResidualBlock(FusedModule):
    """``RMS_norm, SiLU, CausalConv3d, RMS_norm, SiLU, Dropout, CausalConv3d`` + shortcut.

    Norm + SiLU is one ``rms_norm_silu`` pass; the convs run channels-last-3d with their frame
    cache (``causal_conv3d``); the shortcut is added in place into the second conv's output.
    ``_fvd_parts`` (set at install) names the parts in the block's own attribute layout:
    ComfyUI keeps them in ``residual`` (an ``nn.Sequential``), diffusers as named children.
    """

    _fvd_parts: str = "comfy"

    def _parts(self):
        if self._fvd_parts == "comfy":
            r = self.residual
            return r[0], r[2], r[3], r[6], self.shortcut
        return self.norm1, self.conv1, self.norm2, self.conv2, self.conv_shortcut

    def fast_unsupported(self, x, feat_cache=None, feat_idx=None, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        reason = tensor_reason(x)
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

    def fast_forward(self, x, feat_cache=None, feat_idx=None):
        norm1, conv1, norm2, conv2, shortcut = self._parts()
        keep = feat_cache is not None
        idx = feat_idx[0] if keep else 0
        prev1, prev2 = (feat_cache[idx], feat_cache[idx + 1]) if keep else (None, None)

        x = to_cl3d(x)
        h = norm_silu(norm1, x)
        h, cache1 = causal_conv3d(conv1, h, prev1, keep)
        h = norm_silu(norm2, h)  # checked per call: norm2 sees conv1's dtype/device, same as x's
        h, cache2 = causal_conv3d(conv2, h, prev2, keep)
        if isinstance(shortcut, torch.nn.Identity):
            h.add_(x)
        else:
            h.add_(causal_conv3d(shortcut, x, None)[0])

        if keep:  # nothing below can fail: the cache changes only once the block has succeeded
            feat_cache[idx] = cache1
            feat_cache[idx + 1] = cache2
            feat_idx[0] = idx + 2
        return h


class FusedWanCausalConv3d(FusedModule):
    """A ``CausalConv3d`` outside a fused block (decoder ``conv1``, head, ``time_conv``).

    ComfyUI's version takes its cache either as ``cache_x`` or as ``cache_list[cache_idx]``,
    which it clears (so the old frames can be freed early); diffusers' takes ``cache_x``.
    """

    def fast_unsupported(self, x, cache_x=None, cache_list=None, cache_idx=None, *args, **kwargs):
        if args or kwargs:
            return "extra arguments"
        reason = tensor_reason(x)
        if reason is not None:
            return reason
        if cache_list is not None:
            reason = cache_entry_reason(cache_list, [cache_idx], 1)
            if reason is not None:
                return reason
            cache_x = cache_list[cache_idx]
        if cache_x is not None and (not isinstance(cache_x, torch.Tensor) or cache_x.dim() != 5):
            return "cache is not a 5-D tensor"
        return conv_weights_reason(self, x)

    def fast_forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if cache_list is not None:
            cache_x = cache_list[cache_idx]
        out, _ = causal_conv3d(self, to_cl3d(x), cache_x)
        if cache_list is not None:
            cache_list[cache_idx] = None  # the stock module's release, after the last failure point
        return out


class FusedRMSNorm(FusedModule):
    """A standalone ``RMS_norm`` (the decoder head's): ``rms_norm_silu`` without SiLU.

    The SiLU after it stays a stock ``nn.SiLU``: one elementwise pass that keeps the layout.
    """

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return "input is not a 4-D or 5-D tensor"
        return first_reason(tensor_reason(x, x.dim()), norm_reason(self, x))

    def fast_forward(self, x):
        return norm_silu(self, to_cl(x), silu=False)


class FusedWanAttention(FusedModule):
    """The decoder's single-head spatial attention block, per frame, channels-last.

    ComfyUI's stock attention ``view``s q/k/v, which fails on the channels-last tensors the
    fast path produces, so the stock path (gate closed, or a fallback) always gets a contiguous
    input: ``contiguous()`` returns the tensor itself when it already is, so the closed-gate
    path is exactly stock.
    """

    def forward(self, x, *args, **kwargs):
        return super().forward(x.contiguous() if isinstance(x, torch.Tensor) else x, *args, **kwargs)

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        reason = tensor_reason(x)
        if reason is not None:
            return reason
        return first_reason(norm_reason(self.norm, x), conv_weights_reason(self.to_qkv, x),
                            conv_weights_reason(self.proj, x))

    def fast_forward(self, x):
        b, c, t, h, w = x.shape
        identity = to_cl3d(x)
        # (b, c, t, h, w) channels-last-3d is (b, t, h, w, c) in memory: frames as a
        # channels-last image batch is a view.
        frames = identity.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        y = norm_silu(self.norm, to_cl(frames), silu=False)
        qkv = F.conv2d(y, conv_weight(self.to_qkv, torch.channels_last), self.to_qkv.bias)
        qkv = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c)
        q, k, v = qkv.split(c, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(c): the stock attention's
        o = o.reshape(b * t, h, w, c).permute(0, 3, 1, 2)  # channels-last view
        o = F.conv2d(o, conv_weight(self.proj, torch.channels_last), self.proj.bias)
        o = to_cl(o).reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return o + identity


__all__ = [
    "CL3D",
    "FusedRMSNorm",
    "FusedWanAttention",
    "FusedWanCausalConv3d",
    "FusedWanResidualBlock",
]
