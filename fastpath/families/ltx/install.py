"""The LTX VAE family: ComfyUI's ``comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE``
(LTX-Video, LTX-2: pixel norms, causal 3-D convs, depth-to-space upsampling, timestep-
conditioned blocks), in both kinds of its code (whole-input and chunked, ``comfyui.ltx_code``).

Recognised by qualified class name (nothing is imported). Only the decoder is touched; the
decode itself (``VideoVAE.decode``: its noise draw, ``Decoder``'s loop and head) stays stock.

Fail closed twice over, as the Wan family does:
- the whole model is left alone when its decoder holds a module class this file does not know
  (the stock code between fused modules gets channels-last-3d tensors, known to work only for
  the classes listed here);
- each module is checked against what its fused class computes; one that differs (group or
  layer norms in place of pixel norms, unknown code) is left stock with the reason in the
  report.

``CausalDiffusionVAE`` (LTX 2.4/2.5's diffusion decoder) is matched only to say it is not
supported, so the node names it instead of "unsupported VAE".
"""
from __future__ import annotations

import math

import torch

from ....kernels.rms_norm_silu import RMS_NORM_SILU
from ...comfyui.ltx_code import (
    CAUSAL_CONV,
    DEPTH_TO_SPACE,
    DIFFUSION_VAE,
    EMBED_MODULE,
    PIXEL_NORM,
    RESNET_BLOCK,
    VAE_MODULE,
    VIDEO_VAE,
    forward_reason,
    writes_output_in_order,
)
from ...contract import Family, InstallReport, register_family
from ...reasons import first_reason
from ...recognize import is_a
from ...recognize import unknown_module as first_unknown
from ...swap import swap_reason
from .modules import (
    FusedLTXCausalConv3d,
    FusedLTXDepthToSpace,
    FusedLTXPixelNorm,
    FusedLTXResnetBlock,
)
from .ops import causal_conv_static_reason

DIFFUSION_DECODER = ("LTX 2.4/2.5 diffusion decoder (CausalDiffusionVAE) is not supported: "
                     "it decodes on the stock path")

# Stock classes the fast path may hand channels-last-3d tensors to (they slice, chunk, scale,
# rearrange) or that never see activations (the timestep embedders): exact classes.
LAYOUT_SAFE = frozenset({
    f"{VAE_MODULE}.Decoder", f"{VAE_MODULE}.UNetMidBlock3D", f"{VAE_MODULE}.LayerNorm",
    f"{EMBED_MODULE}.PixArtAlphaCombinedTimestepSizeEmbeddings", f"{EMBED_MODULE}.TimestepEmbedding",
    f"{EMBED_MODULE}.Timesteps",
})
KNOWN = (CAUSAL_CONV, RESNET_BLOCK, DEPTH_TO_SPACE, PIXEL_NORM)
TORCH_SAFE = ("torch.nn.modules.conv.Conv3d", "torch.nn.modules.linear.Linear",
              "torch.nn.modules.container.ModuleList", "torch.nn.modules.activation.SiLU",
              "torch.nn.modules.dropout.Dropout", "torch.nn.modules.linear.Identity",
              "torch.nn.modules.normalization.GroupNorm", "torch.nn.modules.normalization.LayerNorm")
STRIDES = ((2, 2, 2), (1, 2, 2), (2, 1, 1))

def matches(model: torch.nn.Module) -> bool:
    return is_a(model, VIDEO_VAE, DIFFUSION_VAE) and isinstance(getattr(model, "decoder", None), torch.nn.Module)


def unknown_module(decoder: torch.nn.Module) -> str | None:
    return first_unknown(decoder, LAYOUT_SAFE | set(KNOWN), TORCH_SAFE)


# --- what each fused class needs; None when the module computes exactly that -----------------


def pixel_norm_reason(norm) -> str | None:
    if not is_a(norm, PIXEL_NORM):
        return f"norm is a {type(norm).__name__}, not a PixelNorm"
    if norm.dim != 1:
        return f"pixel norm over dim {norm.dim}"
    return forward_reason(norm)


def shortcut_reason(m) -> str | None:
    """An identity, or (``res_x_y``) the LTX layer norm over the input's channels then a plain
    1x1x1 conv to the output's."""
    if isinstance(m.conv_shortcut, torch.nn.Identity) and isinstance(m.norm3, torch.nn.Identity):
        return None if m.in_channels == m.out_channels else "block widths"
    conv, norm = m.conv_shortcut, getattr(m.norm3, "norm", None)
    if not (is_a(m.norm3, f"{VAE_MODULE}.LayerNorm") and isinstance(norm, torch.nn.LayerNorm)
            and tuple(norm.normalized_shape) == (m.in_channels,) and norm.elementwise_affine):
        return "shortcut norm is not a layer norm over the input channels"
    if not (isinstance(conv, torch.nn.Conv3d) and tuple(conv.kernel_size) == (1, 1, 1)
            and tuple(conv.stride) == (1, 1, 1) and tuple(conv.padding) == (0, 0, 0)
            and conv.groups == 1 and (conv.in_channels, conv.out_channels) == (m.in_channels, m.out_channels)):
        return "shortcut is not a plain 1x1x1 conv"
    return None


def block_reason(m) -> str | None:
    if m.inject_noise and m.in_channels != m.out_channels:
        return "spatial noise in a channel-changing block"
    reason = shortcut_reason(m)
    if reason is not None:
        return reason
    if type(m.non_linearity) is not torch.nn.SiLU:
        return f"activation {type(m.non_linearity).__name__}"
    if type(m.dropout) is not torch.nn.Dropout:
        return f"dropout is a {type(m.dropout).__name__}"
    if not (is_a(m.conv1, CAUSAL_CONV) and is_a(m.conv2, CAUSAL_CONV)):
        return "block convs are not causal convs"
    c, out = m.in_channels, m.out_channels
    if (m.conv1.conv.in_channels, m.conv1.conv.out_channels, m.conv2.conv.out_channels) != (c, out, out):
        return "block conv widths"
    if m.timestep_conditioning and tuple(m.scale_shift_table.shape) != (4, c):
        return f"scale/shift table of shape {tuple(m.scale_shift_table.shape)}"
    return first_reason(forward_reason(m), pixel_norm_reason(m.norm1), pixel_norm_reason(m.norm2),
                        RMS_NORM_SILU.channels_reason(c), RMS_NORM_SILU.channels_reason(out),
                        causal_conv_static_reason(m.conv1), causal_conv_static_reason(m.conv2))


def depth_to_space_reason(m) -> str | None:
    stride = tuple(m.stride)
    if stride not in STRIDES:
        return f"stride {stride}"
    if not is_a(m.conv, CAUSAL_CONV):
        return "upsampler conv is not a causal conv"
    reason = forward_reason(m) or causal_conv_static_reason(m.conv)
    if reason is not None:
        return reason
    n = math.prod(stride)
    cin, cout = m.conv.conv.in_channels, m.conv.conv.out_channels
    if cout != m.out_channels or cout % n:
        return "upsampler conv width"
    if m.residual and (cin % n or n % m.out_channels_reduction_factor
                       or (cin // n) * (n // m.out_channels_reduction_factor) != cout // n):
        return "residual widths"
    return None


# --- install -------------------------------------------------------------------------------


def _swap(report: InstallReport, path: str, m, mixin, reason: str | None, gate, channels,
          **attrs) -> None:
    report.record(path, reason or swap_reason(m, mixin, _fvd_gate=gate, _fvd_channels=channels, **attrs))


def install(model: torch.nn.Module, gate, report: InstallReport) -> None:
    if is_a(model, DIFFUSION_VAE):
        report.reason = DIFFUSION_DECODER
        return
    decoder = model.decoder
    reason = unknown_module(decoder)
    if reason is not None:
        report.reason = reason
        return
    head = getattr(decoder, "conv_norm_out", None)
    head_conv = getattr(decoder, "conv_out", None)
    writes_in_order = writes_output_in_order(decoder)
    head_channels = getattr(getattr(head_conv, "conv", None), "in_channels", None)
    for path, m in decoder.named_modules(prefix="decoder"):
        if is_a(m, RESNET_BLOCK):
            _swap(report, path, m, FusedLTXResnetBlock, block_reason(m), gate, m.in_channels)
        elif is_a(m, DEPTH_TO_SPACE):
            _swap(report, path, m, FusedLTXDepthToSpace, depth_to_space_reason(m), gate,
                  m.conv.conv.in_channels)
        elif is_a(m, CAUSAL_CONV):
            _swap(report, path, m, FusedLTXCausalConv3d, causal_conv_static_reason(m), gate,
                  m.conv.in_channels, _fvd_writes_output=m is head_conv and writes_in_order)
        elif m is head and is_a(m, PIXEL_NORM):
            reason = pixel_norm_reason(m) or (None if head_channels else "head width unknown")
            _swap(report, path, m, FusedLTXPixelNorm, reason, gate, head_channels)


register_family(Family("ltx", matches, install))
