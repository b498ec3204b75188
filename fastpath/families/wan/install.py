"""The Wan VAE family: Wan 2.1 / Qwen-Image and Wan 2.2 video VAEs, ComfyUI's and diffusers'.

Recognised by qualified class name (nothing is imported): ComfyUI ``comfy.ldm.wan.vae.WanVAE``,
``comfy.ldm.wan.vae2_2.WanVAE`` and diffusers ``AutoencoderKLWan`` (``is_residual`` selects the
Wan 2.2 structure there). Only the decoder and the top-level decode loop are touched.

Fail closed twice over:
- the whole model is left alone when its decoder holds a module class this file does not know
  (a newer ComfyUI): the fast path hands channels-last-3d tensors to the stock modules between
  the fused ones, which is only known to work for the classes listed here;
- each module is checked against what its fused class computes; one that differs is left
  stock with the reason in the report.
"""
from __future__ import annotations

import torch

from ....kernels.dup_up_3d import DUP_UP_3D
from ...contract import Family, InstallReport, register_family
from ...reasons import first_reason
from ...recognize import is_a, is_wan_vae_model
from ...recognize import unknown_module as first_unknown
from ...swap import stock_class, swap_in, swap_reason
from .decode import install_decode_loop
from .exact import ExactRMSNorm, exact_norm_reason
from .join_first import JoinedRunUp, run_up_reason
from .modules import (
    FusedRMSNorm,
    FusedWanAttention,
    FusedWanCausalConv3d,
    FusedWanDupUp3D,
    FusedWanResample,
    FusedWanResidualBlock,
    SiLUAfterNorm,
)
from .ops import (
    cache_rule,
    causal_conv_static_reason,
    forward_code_reason,
    ignored_args,
    pads,
    rms_norm_static_reason,
)

_V21 = "comfy.ldm.wan.vae"
_V22 = "comfy.ldm.wan.vae2_2"
_DIF = "diffusers.models.autoencoders.autoencoder_kl_wan"

COMFY_BLOCKS = (f"{_V21}.ResidualBlock", f"{_V22}.ResidualBlock")
DIFFUSERS_BLOCKS = (f"{_DIF}.WanResidualBlock",)
CAUSAL_CONVS = (f"{_V21}.CausalConv3d", f"{_DIF}.WanCausalConv3d")
RMS_NORMS = (f"{_V21}.RMS_norm", f"{_DIF}.WanRMS_norm")
ATTENTIONS = (f"{_V21}.AttentionBlock", f"{_DIF}.WanAttentionBlock")
RESAMPLES = (f"{_V21}.Resample", f"{_V22}.Resample", f"{_DIF}.WanResample")
DUP_UPS = (f"{_V22}.DupUp3D", f"{_DIF}.DupUp3D")

# Stock modules the fast path may hand channels-last-3d tensors to, checked to be layout-agnostic
# (they reshape/slice/concatenate; ``view``s only where the layout allows it): exact classes.
LAYOUT_SAFE = frozenset({
    f"{_V21}.Decoder3d", f"{_V21}.Resample", f"{_V22}.Decoder3d", f"{_V22}.Resample",
    f"{_V22}.Up_ResidualBlock", f"{_V22}.DupUp3D",
    f"{_DIF}.WanDecoder3d", f"{_DIF}.WanMidBlock", f"{_DIF}.WanUpBlock", f"{_DIF}.WanResidualUpBlock",
    f"{_DIF}.WanResample", f"{_DIF}.WanUpsample", f"{_DIF}.DupUp3D",
})
# Plain torch building blocks (and their subclasses, e.g. ComfyUI's ops.Conv2d).
TORCH_SAFE = ("torch.nn.modules.conv.Conv2d", "torch.nn.modules.container.Sequential",
              "torch.nn.modules.container.ModuleList", "torch.nn.modules.activation.SiLU",
              "torch.nn.modules.dropout.Dropout", "torch.nn.modules.upsampling.Upsample",
              "torch.nn.modules.linear.Identity")
KNOWN = COMFY_BLOCKS + DIFFUSERS_BLOCKS + CAUSAL_CONVS + RMS_NORMS + ATTENTIONS
# Temporal kernels of the block and time convs: 3 (every Wan VAE so far) and 1 (newest
# ``vae2_2``'s ``temporal_kernel=1``: no time padding, the cache is never read).
TEMPORAL_KERNELS = (1, 3)


def matches(model: torch.nn.Module) -> bool:
    return is_wan_vae_model(model) and isinstance(getattr(model, "decoder", None), torch.nn.Module)


def unknown_module(decoder: torch.nn.Module) -> str | None:
    return first_unknown(decoder, LAYOUT_SAFE | set(KNOWN), TORCH_SAFE)


# --- what each fused class needs; None when the module computes exactly that -----------------


def _silu_reason(m) -> str | None:
    return None if type(m) is torch.nn.SiLU else f"activation {type(m).__name__}"


def _shortcut_reason(m) -> str | None:
    if type(m) is torch.nn.Identity:
        return None
    if not is_a(m, *CAUSAL_CONVS):
        return f"shortcut is a {type(m).__name__}"
    reason = causal_conv_static_reason(m, kernel_t=1)
    if reason is None and any(pads(m)):
        return "padded shortcut conv"
    return reason


def comfy_block_reason(m) -> str | None:
    r = getattr(m, "residual", None)
    if not isinstance(r, torch.nn.Sequential) or len(r) != 7:
        return "residual is not the 7-layer Sequential"
    if not (is_a(r[0], *RMS_NORMS) and is_a(r[3], *RMS_NORMS)
            and is_a(r[2], *CAUSAL_CONVS) and is_a(r[6], *CAUSAL_CONVS)
            and type(r[5]) is torch.nn.Dropout):
        return "residual layers differ from RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv"
    return first_reason(forward_code_reason(m),
                        rms_norm_static_reason(r[0]), rms_norm_static_reason(r[3]),
                        _silu_reason(r[1]), _silu_reason(r[4]),
                        causal_conv_static_reason(r[2], TEMPORAL_KERNELS),
                        causal_conv_static_reason(r[6], TEMPORAL_KERNELS),
                        _shortcut_reason(m.shortcut))


def diffusers_block_reason(m) -> str | None:
    if not (is_a(m.norm1, *RMS_NORMS) and is_a(m.norm2, *RMS_NORMS)
            and is_a(m.conv1, *CAUSAL_CONVS) and is_a(m.conv2, *CAUSAL_CONVS)):
        return "block layers differ from WanRMS_norm / WanCausalConv3d"
    if type(m.dropout) is not torch.nn.Dropout:
        return f"dropout is a {type(m.dropout).__name__}"
    return first_reason(rms_norm_static_reason(m.norm1), rms_norm_static_reason(m.norm2),
                        _silu_reason(m.nonlinearity),
                        causal_conv_static_reason(m.conv1, 3), causal_conv_static_reason(m.conv2, 3),
                        _shortcut_reason(m.conv_shortcut))


def attention_reason(m) -> str | None:
    for conv in (m.to_qkv, m.proj):
        if not isinstance(conv, torch.nn.Conv2d) or tuple(conv.kernel_size) != (1, 1):
            return "q/k/v or output projection is not a 1x1 Conv2d"
        if tuple(conv.stride) != (1, 1) or tuple(conv.padding) != (0, 0) or conv.groups != 1:
            return "projection conv stride/padding/groups"
    if m.to_qkv.out_channels != 3 * m.proj.in_channels:
        return "q/k/v width"
    return forward_code_reason(m) or rms_norm_static_reason(m.norm)


def resample_reason(m) -> str | None:
    if m.mode not in ("upsample2d", "upsample3d"):
        return f"mode {m.mode}"
    reason = forward_code_reason(m)
    if reason is not None:
        return reason
    r = getattr(m, "resample", None)
    if not isinstance(r, torch.nn.Sequential) or len(r) != 2:
        return "resample is not Upsample + Conv2d"
    up, conv = r
    if not isinstance(up, torch.nn.Upsample) or up.mode not in ("nearest", "nearest-exact"):
        return "resample does not start with a nearest Upsample"
    if up.size is not None or tuple(float(f) for f in up.scale_factor) != (2.0, 2.0):
        return f"upsample scale {up.scale_factor}"
    if (not isinstance(conv, torch.nn.Conv2d) or tuple(conv.kernel_size) != (3, 3)
            or tuple(conv.stride) != (1, 1) or tuple(conv.padding) != (1, 1)
            or tuple(conv.dilation) != (1, 1) or conv.groups != 1 or conv.padding_mode != "zeros"):
        return "resample conv is not a plain 3x3 conv with padding 1"
    if m.mode == "upsample3d":
        tc = m.time_conv
        reason = causal_conv_static_reason(tc, kernel_t=TEMPORAL_KERNELS)
        if reason is not None:
            return reason
        if tuple(tc.kernel_size[1:]) != (1, 1) or tc.out_channels != 2 * tc.in_channels:
            return "time conv is not the (k, 1, 1) conv to twice the channels"
    return None


def dup_up_reason(m) -> str | None:
    """The shortcut's factors as ``dup_up_3d`` reads them (its channels and repeats agree)."""
    try:
        c_in, c_out, ft, fs, repeats = (int(getattr(m, name)) for name in
                                        ("in_channels", "out_channels", "factor_t", "factor_s", "repeats"))
    except (AttributeError, TypeError, ValueError):
        return "DupUp3D without integer channels, factors and repeats"
    if min(c_in, c_out, ft, fs) < 1 or repeats * c_in != c_out * ft * fs * fs:
        return "DupUp3D repeats do not match its channels and factors"
    return forward_code_reason(m) or DUP_UP_3D.channels_reason(c_out)


def head_norms(decoder) -> list:
    """The decoder's output norm."""
    head = getattr(decoder, "head", None)
    if isinstance(head, torch.nn.Sequential) and len(head) and is_a(head[0], *RMS_NORMS):
        return [head[0]]
    norm = getattr(decoder, "norm_out", None)
    return [norm] if is_a(norm, *RMS_NORMS) else []


def head_silu(decoder) -> torch.nn.Module | None:
    """The plain ``nn.SiLU`` the decoder applies right after its output norm (ComfyUI:
    ``head[1]``; diffusers: ``nonlinearity``, used there only for the head), if it has one."""
    head = getattr(decoder, "head", None)
    if isinstance(head, torch.nn.Sequential):
        silu = head[1] if len(head) > 1 else None
    else:
        silu = getattr(decoder, "nonlinearity", None)
    return silu if isinstance(silu, torch.nn.SiLU) and stock_class(silu) is torch.nn.SiLU else None


# --- install -------------------------------------------------------------------------------


def _swap(report: InstallReport, path: str, m, mixin, reason: str | None, gate, **attrs) -> None:
    report.record(path, reason or swap_reason(m, mixin, _fvd_gate=gate, **attrs))


def install(model: torch.nn.Module, gate, report: InstallReport) -> None:
    decoder = model.decoder
    reason = unknown_module(decoder)
    if reason is not None:
        report.reason = reason
        return
    loop_reason = install_decode_loop(model)
    if loop_reason is None:
        report.fused += 1
    else:
        report.skipped["decode"] = loop_reason
    if run_up_reason(decoder) is None:  # ComfyUI 0.33+'s pieces (``join_first``)
        swap_in(decoder, JoinedRunUp)
    heads = {id(n) for n in head_norms(decoder)}
    for path, m in decoder.named_modules(prefix="decoder"):
        if is_a(m, *COMFY_BLOCKS):
            _swap(report, path, m, FusedWanResidualBlock, comfy_block_reason(m), gate, _fvd_parts="comfy",
                  _fvd_cache_rule=cache_rule(m), _fvd_ignored=ignored_args(m))
        elif is_a(m, *DIFFUSERS_BLOCKS):
            _swap(report, path, m, FusedWanResidualBlock, diffusers_block_reason(m), gate,
                  _fvd_parts="diffusers")
        elif is_a(m, *CAUSAL_CONVS):
            _swap(report, path, m, FusedWanCausalConv3d, causal_conv_static_reason(m), gate)
        elif is_a(m, *RESAMPLES):
            _swap(report, path, m, FusedWanResample, resample_reason(m), gate,
                  _fvd_cache_rule=cache_rule(m), _fvd_ignored=ignored_args(m))
        elif is_a(m, *DUP_UPS):
            _swap(report, path, m, FusedWanDupUp3D, dup_up_reason(m), gate)
        elif is_a(m, *ATTENTIONS):
            _swap(report, path, m, FusedWanAttention, attention_reason(m), gate,
                  _fvd_ignored=ignored_args(m))
        elif id(m) in heads:
            # The SiLU after it goes into the norm's kernel where the SiLU can pass it on.
            silu = head_silu(decoder)
            folds = silu is not None and swap_in(silu, SiLUAfterNorm)
            _swap(report, path, m, FusedRMSNorm, rms_norm_static_reason(m), gate,
                  _fvd_exact=exact_norm_reason(m) is None, _fvd_silu=folds)
        elif is_a(m, *RMS_NORMS) and exact_norm_reason(m) is None:
            # Not fused (its block or attention fuses it), but its stock path gets cheaper.
            swap_in(m, ExactRMSNorm, _fvd_exact=True)


register_family(Family("wan", matches, install))
