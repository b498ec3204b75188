"""Fused modules of ComfyUI's LTX VAE decoder (``comfy.ldm.lightricks.vae``), installed by class
swap (see ``install.py``).

While the gate is open activations are channels-last-3d from the first fused module on. The
stock code between them (``Decoder``'s loop and head, ``UNetMidBlock3D``, ``unpatchify``) only
chunks, slices, scales, shifts and rearranges, which works in any layout.

Noise: ``VideoVAE.decode`` draws ``torch.randn_like`` on every timestep-conditioned decode; that
stays stock code, so the generator is consumed exactly as stock in both qualities. Blocks that
inject spatial noise of their own (``inject_noise``, LTX-Video 0.9.1) draw in their stock
forward and are left stock.

Frame state (0.33): every fast path computes first and writes ``temporal_cache_state`` last,
through the commits of ``ops`` (see there), so a stock retry after an exception is exact.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ....kernels.rms_norm_silu import RMS_NORM_SILU, rms_norm_silu, rms_norm_silu_unsupported
from ...comfyui.weights import bias_of, weight_of
from ...fused import FusedModule
from ...pixels.frames import BufferSink, frames_sink
from ...prewarm import tiny_input
from ...reasons import first_reason, input_reason
from ...video_ops import (
    CL3D,
    add_parts,
    conv_weight,
    conv_weights_reason,
    sum_parts,
    to_cl,
    to_cl3d,
)
from .ops import (
    ConvInput,
    causal_conv,
    chunked,
    conv_frame_reason,
    conv_input,
    conv_output,
    depth_to_space,
    exchange_add,
    no_commit,
    thread_key,
)


def _extra_reason(args, kwargs, allowed: tuple[str, ...]) -> str | None:
    if args or not set(kwargs) <= set(allowed):
        return "extra arguments"
    return None


def _video_reason(x) -> str | None:
    reason = input_reason(x, RMS_NORM_SILU, rank=5)
    if reason is None and x.shape[2] == 0:
        return "no frames"  # the stock module's own empty-input rules apply
    return reason


def pixel_norm(x: torch.Tensor, eps: float, gamma=None, bias=None, silu: bool = False, *,
               addends: tuple = (), in_bias=None, into: ConvInput | None = None) -> torch.Tensor:
    """``rms_norm_silu`` as the pixel norm of channels-last ``x + addends + in_bias``; with
    ``into``, written straight into that conv input's frames (its reflected border too, where
    the kernel writes it), so the conv reads the norm's output without a copy.

    Callers checked the plain input; a kernel refusing only the folded inputs or the target
    is handled by summing in torch first (same math up to one rounding) and copying; refusing
    ``x`` itself means the checks and the kernel disagree, and raising sends the caller to its
    stock path.
    """
    kw = dict(eps=eps, silu=silu, mean_eps=True)
    if into is not None and not into.empty:
        border = into.border if into.border == 1 else 0  # the kernel writes a 1-pixel border
        y = rms_norm_silu(x, gamma, bias, addends=addends, in_bias=in_bias, out=into.target(),
                          out_border=border, **kw)
        if y is not None:
            into.written(bordered=border == into.border)
            return y
        y = pixel_norm(x, eps, gamma, bias, silu, addends=addends, in_bias=in_bias)
        into.take(y)
        return into.frames
    y = rms_norm_silu(x, gamma, bias, addends=addends, in_bias=in_bias, **kw)
    if y is not None:
        return y
    if addends or in_bias is not None:
        x = sum_parts([x.clone()] + list(addends), in_bias)
    y = rms_norm_silu(x, gamma, bias, **kw)
    if y is None:
        raise RuntimeError("rms_norm_silu declined: " + str(rms_norm_silu_unsupported(x, gamma, bias)))
    return y


@contextlib.contextmanager
def _frame_state_kept(module: torch.nn.Module):
    """Restore every ``temporal_cache_state`` under ``module`` (a warm-up must leave none)."""
    saved = [(m, dict(m.temporal_cache_state)) for m in module.modules()
             if isinstance(getattr(m, "temporal_cache_state", None), dict)]
    try:
        yield
    finally:
        for m, state in saved:
            m.temporal_cache_state.clear()
            m.temporal_cache_state.update(state)


class _Prewarmed(FusedModule):
    """Warm-up on a tiny video input, with the module's frame state left as it was."""

    _fvd_prewarm_rank = 5
    _fvd_channels: int | None = None  # input channels, set at install

    def prewarm_channels(self):
        return self._fvd_channels

    def prewarm_kwargs(self, x: torch.Tensor) -> dict:
        return {}

    def prewarm(self, device, dtype) -> None:
        x = tiny_input(self._fvd_channels, 5, device, dtype)
        kwargs = self.prewarm_kwargs(x)
        with _frame_state_kept(self):
            self.prewarm_call(x, **kwargs)


class FusedLTXCausalConv3d(_Prewarmed):
    """A ``CausalConv3d`` (decoder ``conv_in``/``conv_out``; the ones inside fused blocks and
    upsamplers are run by those directly): ``ops.causal_conv`` plus its bias.

    The decoder's head conv of code that writes each head output into the decode's output
    buffer, in order (``_fvd_writes_output``, set at install), tells the pixel output's
    ``BufferSink`` after each call, fused or stock, how many frames the decoder writes next."""

    _fvd_writes_output = False

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        sink = frames_sink() if self._fvd_writes_output else None
        if isinstance(sink, BufferSink) and isinstance(out, torch.Tensor):
            sink.next_write(out.shape[2])
        return out

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if len(args) > 1:
            return "extra arguments"
        return first_reason(_extra_reason((), kwargs, ("causal",)), _video_reason(x),
                            conv_frame_reason(self, x), conv_weights_reason(self.conv, x))

    def fast_forward(self, x, causal: bool = True):
        x = to_cl3d(x)
        parts, commit = causal_conv(self, x, causal)
        out = conv_output(self, x, parts)
        commit()
        return out


class FusedLTXPixelNorm(_Prewarmed):
    """A standalone ``PixelNorm`` (the decoder head's; the decoder scales, shifts and applies
    SiLU after it in stock code, which keeps the layout)."""

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if args or kwargs:
            return "extra arguments"
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return "input is not a 4-D or 5-D tensor"
        return input_reason(x, RMS_NORM_SILU) or RMS_NORM_SILU.channels_reason(x.shape[1])

    def fast_forward(self, x):
        return pixel_norm(to_cl(x), self.eps)


class FusedLTXResnetBlock(_Prewarmed):
    """``ResnetBlock3D`` with pixel norms: pixel norm (* (1 + scale) + shift when timestep-
    conditioned) + SiLU in one pass, causal conv, the same with conv1's bias folded into the
    norm's read, causal conv, then conv2's output + bias + residual in one pass (0.33: the
    residual frames aligned across chunks as the stock block does). Spatial noise (LTX-Video
    0.9.1's ``inject_noise``) is drawn and added after each conv as stock does it; a
    channel-changing block (``res_x_y``) takes its residual through its layer norm and 1x1x1
    conv."""

    def _affine(self, x: torch.Tensor, timestep):
        """(gamma1, bias1, gamma2, bias2) of the two norms, fp32; all None unconditioned."""
        if not self.timestep_conditioning:
            return None, None, None, None
        c = x.shape[1]
        ada = (self.scale_shift_table.to(device=x.device, dtype=torch.float32)
               + timestep.reshape(4, c).to(torch.float32))
        shift1, scale1, shift2, scale2 = ada.unbind(0)
        return 1 + scale1, shift1, 1 + scale2, shift2

    def _timestep_reason(self, x, timestep) -> str | None:
        if not self.timestep_conditioning:
            return None
        if not isinstance(timestep, torch.Tensor):
            return "no timestep embedding"
        if x.shape[0] != 1:
            return "batch > 1 with timestep conditioning (per-sample scale and shift)"
        if timestep.numel() != 4 * x.shape[1] or tuple(timestep.shape[-3:]) != (1, 1, 1):
            return f"timestep embedding of shape {tuple(timestep.shape)}"
        if timestep.device != x.device:
            return f"timestep embedding on {timestep.device}, input on {x.device}"
        return None

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if len(args) > 2:
            return "extra arguments"
        reason = _extra_reason((), kwargs, ("causal", "timestep")) or _video_reason(x)
        if reason is not None:
            return reason
        if self.training:
            return "training mode (dropout)"
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        shortcut = () if isinstance(self.conv_shortcut, torch.nn.Identity) else (
            conv_weights_reason(self.conv_shortcut, x), conv_weights_reason(self.norm3.norm, x))
        return first_reason(self._timestep_reason(x, timestep), conv_frame_reason(self.conv1, x),
                            conv_weights_reason(self.conv1.conv, x),
                            conv_weights_reason(self.conv2.conv, x), *shortcut)

    def prewarm_kwargs(self, x: torch.Tensor) -> dict:
        if not self.timestep_conditioning:
            return {}
        return {"timestep": torch.zeros((1, 4 * x.shape[1], 1, 1, 1), device=x.device, dtype=x.dtype)}

    def fast_forward(self, input_tensor, causal: bool = True, timestep=None):
        x = to_cl3d(input_tensor)
        g1, b1, g2, b2 = self._affine(x, timestep)
        # Each norm writes its conv's input buffer itself (see ``pixel_norm``); a buffer is
        # let go once its conv has run.
        inp = conv_input(self.conv1, x, causal)
        pixel_norm(x, self.norm1.eps, g1, b1, silu=True, into=inp)
        parts, commit1 = inp.convolve()
        if parts and not self.inject_noise:
            inp = conv_input(self.conv2, parts[0], causal)
            pixel_norm(parts[0], self.norm2.eps, g2, b2, silu=True, addends=tuple(parts[1:]),
                       in_bias=bias_of(self.conv1.conv), into=inp)
        else:  # conv_output takes x for the shape of the frames conv1 read
            h = self._noised(conv_output(self.conv1, x, parts), "per_channel_scale1")
            inp = conv_input(self.conv2, h, causal)
            pixel_norm(h, self.norm2.eps, g2, b2, silu=True, into=inp)
            del h
        del parts
        parts, commit2 = inp.convolve()
        del inp
        bias = bias_of(self.conv2.conv)
        if not parts or self.inject_noise:
            parts, bias = [self._noised(conv_output(self.conv2, x, parts), "per_channel_scale2")], None
        residual = self._shortcut(x)
        commit3 = no_commit
        if chunked(self):
            key = thread_key()
            out, rest = exchange_add(parts[0], bias, tuple(parts[1:]),
                                     self.temporal_cache_state.get(key), residual)
            commit3 = lambda: self.temporal_cache_state.__setitem__(key, rest)  # noqa: E731
        else:
            out = add_parts(parts, bias, residual)
        for commit in (commit1, commit2, commit3):  # plain dict stores: nothing can fail now
            commit()
        return out

    def _noised(self, h: torch.Tensor, scale_name: str) -> torch.Tensor:
        """``h`` plus the block's spatial noise, drawn by the stock block's own method at the
        point of the stock forward, so the generator is consumed exactly as stock (one draw per
        call, frames or not)."""
        if not self.inject_noise:
            return h
        scale = getattr(self, scale_name)
        return to_cl3d(self._feed_spatial_noise(h, scale.to(device=h.device, dtype=h.dtype)))

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """The residual: ``x``, or for a channel-changing block its layer norm (over channels,
        which channels-last-3d memory holds innermost) then the 1x1x1 conv."""
        if isinstance(self.conv_shortcut, torch.nn.Identity):
            return x
        ln = self.norm3.norm
        y = F.layer_norm(x.permute(0, 2, 3, 4, 1), ln.normalized_shape, weight_of(ln), bias_of(ln), ln.eps)
        conv = self.conv_shortcut
        return to_cl3d(F.conv3d(y.permute(0, 4, 1, 2, 3), conv_weight(conv, CL3D), bias_of(conv)))


class FusedLTXDepthToSpace(_Prewarmed):
    """``DepthToSpaceUpsample``: causal conv, then ``b (c p1 p2 p3) d h w -> b c (d p1) (h p2)
    (w p3)`` written once into a channels-last-3d tensor, with the residual (the input
    rearranged the same way, repeated over channels) added in the same pass; the first frame
    dropped for a time stride of 2 (a view). Across 0.33's chunks the residual frames are
    aligned as the stock module does (a separate add where they do not line up)."""

    def fast_unsupported(self, x, *args, **kwargs) -> str | None:
        if len(args) > 2:
            return "extra arguments"
        return first_reason(_extra_reason((), kwargs, ("causal", "timestep")), _video_reason(x),
                            conv_frame_reason(self.conv, x), conv_weights_reason(self.conv.conv, x))

    def _repeat(self) -> int:
        return math.prod(self.stride) // self.out_channels_reduction_factor

    def fast_forward(self, x, causal: bool = True, timestep=None):
        x = to_cl3d(x)
        parts, commit_conv = causal_conv(self.conv, x, causal)
        y = conv_output(self.conv, x, parts)
        del parts
        stride = tuple(self.stride)
        drops = stride[0] == 2
        key = thread_key() if chunked(self) else None
        cached, drop_conv, drop_res = ((None, True, True) if key is None
                                       else self.temporal_cache_state.get(key, (None, True, True)))
        y_drop = drops and drop_conv and y.shape[2] > 0
        x_drop = drops and drop_res  # x has frames (fast_unsupported)
        state = None
        if not self.residual:
            out = depth_to_space(y, stride)
            out = out[:, :, 1:] if y_drop else out
            state = (None, drop_conv and not y_drop, False)
        elif (cached is None or cached.shape[2] == 0) and y.shape[2] == x.shape[2] and y_drop == x_drop:
            # Output and residual frames line up (always without chunks): one pass.
            out = depth_to_space(y, stride, x, self._repeat())
            out = out[:, :, 1:] if y_drop else out
            empty = torch.empty((x.shape[0], out.shape[1], 0) + tuple(out.shape[3:]),
                                dtype=out.dtype, device=out.device)
            state = (empty, drop_conv and not y_drop, drop_res and not x_drop)
        else:
            out = depth_to_space(y, stride)
            out = out[:, :, 1:] if y_drop else out
            x_in = to_cl3d(depth_to_space(x, stride).repeat(1, self._repeat(), 1, 1, 1))
            x_in = x_in[:, :, 1:] if x_drop else x_in
            if out.shape[2] == 0:
                rest = x_in if cached is None else to_cl3d(torch.cat([cached, x_in], dim=2))
                out = None  # the stock module returns None here
            else:
                out, rest = exchange_add(out, None, (), cached, x_in)
            state = (rest, drop_conv and not y_drop, drop_res and not x_drop)
        commit_conv()
        if key is not None:
            self.temporal_cache_state[key] = state
        return out


__all__ = ["CL3D", "FusedLTXCausalConv3d", "FusedLTXDepthToSpace", "FusedLTXPixelNorm",
           "FusedLTXResnetBlock"]
