"""The KL image-VAE family: SD1.x, SDXL, SD3, Flux, Flux2 decoders, ComfyUI's and diffusers'.

Recognised by qualified class name (nothing is imported):
- ComfyUI ``comfy.ldm.models.autoencoder.AutoencoderKL`` / ``AutoencodingEngine`` (the Flux VAE
  has no ``post_quant_conv``, so ComfyUI builds the latter) whose ``decoder`` is exactly
  ``comfy.ldm.modules.diffusionmodules.model.Decoder`` in its 2-D form;
- diffusers ``AutoencoderKL`` / ``AutoencoderKLFlux2`` whose ``decoder`` is exactly
  ``diffusers.models.autoencoders.vae.Decoder``;
- either decoder passed on its own.

Module classes are matched exactly, not by ``isinstance``: subclasses such as ComfyUI's
``temporal_ae.VideoDecoder``/``VideoResBlock`` compute something else. The same ComfyUI
``Decoder`` class also builds 3-D (video) decoders (``conv3d=True``); those are left stock.

Each module is checked against what its fused class computes; one that differs is left stock
with the reason in the report (fail closed per module). Only the decoder is touched.
"""
from __future__ import annotations

import torch

from ...contract import Family, InstallReport, register_family
from ...reasons import first_reason
from ...recognize import is_a, stock_class_name
from ...swap import swap_reason
from .decoder import FusedComfyDecoder, FusedDiffusersDecoder
from .modules import (
    DIFFUSERS_ATTENTION_PROCESSORS,
    FusedComfyAttnBlock,
    FusedComfyResnetBlock,
    FusedComfyUpsample,
    FusedDiffusersAttention,
    FusedDiffusersResnetBlock2D,
    FusedDiffusersUpsample2D,
)
from .ops import FusedGroupNormSiLU, conv_static_reason, group_norm_static_reason

_COMFY_MODEL = "comfy.ldm.modules.diffusionmodules.model"
COMFY_MODELS = (
    "comfy.ldm.models.autoencoder.AutoencoderKL",
    "comfy.ldm.models.autoencoder.AutoencodingEngine",
)
COMFY_DECODER = f"{_COMFY_MODEL}.Decoder"
COMFY_RESNET = f"{_COMFY_MODEL}.ResnetBlock"
COMFY_ATTN = f"{_COMFY_MODEL}.AttnBlock"
COMFY_UPSAMPLE = f"{_COMFY_MODEL}.Upsample"

DIFFUSERS_MODELS = (
    "diffusers.models.autoencoders.autoencoder_kl.AutoencoderKL",
    "diffusers.models.autoencoders.autoencoder_kl_flux2.AutoencoderKLFlux2",
)
DIFFUSERS_DECODER = "diffusers.models.autoencoders.vae.Decoder"
DIFFUSERS_RESNET = "diffusers.models.resnet.ResnetBlock2D"
DIFFUSERS_ATTENTION = "diffusers.models.attention_processor.Attention"
DIFFUSERS_UPSAMPLE = "diffusers.models.upsampling.Upsample2D"
DIFFUSERS_MID_BLOCK = "diffusers.models.unets.unet_2d_blocks.UNetMidBlock2D"
DIFFUSERS_UP_BLOCK = "diffusers.models.unets.unet_2d_blocks.UpDecoderBlock2D"


def kl_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The KL decoder of ``model`` (a recognised autoencoder or a bare decoder), else None."""
    if stock_class_name(model) in (COMFY_DECODER, DIFFUSERS_DECODER):
        return model
    decoder = getattr(model, "decoder", None)
    if is_a(model, *COMFY_MODELS) and stock_class_name(decoder) == COMFY_DECODER:
        return decoder
    if is_a(model, *DIFFUSERS_MODELS) and stock_class_name(decoder) == DIFFUSERS_DECODER:
        return decoder
    return None


def matches(model: torch.nn.Module) -> bool:
    return kl_decoder(model) is not None


# --- what each fused class needs; None when the module computes exactly that ------------------


def _norms_reason(*norms):
    return first_reason(*(group_norm_static_reason(n) for n in norms))


def comfy_resnet_reason(m) -> str | None:
    shortcut = None
    if m.in_channels != m.out_channels:
        shortcut = (conv_static_reason(m.conv_shortcut, 3, 1) if m.use_conv_shortcut
                    else conv_static_reason(m.nin_shortcut, 1, 0))
    return first_reason(_norms_reason(m.norm1, m.norm2), conv_static_reason(m.conv1, 3, 1),
                        conv_static_reason(m.conv2, 3, 1), shortcut)


def diffusers_resnet_reason(m) -> str | None:
    # Without a time embedding (temb is None; checked per call) "default" and the decoder's
    # "group" both run plain norm2; "scale_shift" needs a temb and raises in stock without one.
    if m.time_embedding_norm == "scale_shift":
        return "scale-shift time embedding norm"
    if m.upsample is not None or m.downsample is not None:
        return "resampling inside the res block"
    if not isinstance(m.nonlinearity, torch.nn.SiLU):
        return f"activation {type(m.nonlinearity).__name__}"
    if getattr(m, "conv2d_out_channels", None) not in (None, m.out_channels):
        return "conv2 output differs from the block's"
    shortcut = None if m.conv_shortcut is None else conv_static_reason(m.conv_shortcut, 1, 0)
    return first_reason(_norms_reason(m.norm1, m.norm2), conv_static_reason(m.conv1, 3, 1),
                        conv_static_reason(m.conv2, 3, 1), shortcut)


def comfy_attn_reason(m) -> str | None:
    return first_reason(_norms_reason(m.norm),
                        *(conv_static_reason(c, 1, 0) for c in (m.q, m.k, m.v, m.proj_out)))


def diffusers_attention_reason(m) -> str | None:
    if type(m.processor).__name__ not in DIFFUSERS_ATTENTION_PROCESSORS:
        return f"attention processor {type(m.processor).__name__}"
    if m.heads != 1:
        return f"{m.heads} attention heads"
    if (m.spatial_norm is not None or m.norm_q is not None or m.norm_k is not None
            or m.group_norm is None):
        return "attention norms differ from the KL VAE's"
    if not m.residual_connection or m.is_cross_attention or getattr(m, "add_k_proj", None):
        return "not a self-attention block with a residual"
    if not getattr(m, "scale_qk", True):
        return "unscaled attention"
    linears = (m.to_q, m.to_k, m.to_v, m.to_out[0])
    c = m.group_norm.num_channels
    if any(not isinstance(lin, torch.nn.Linear) or lin.in_features != c or lin.out_features != c
           for lin in linears):
        return "projections are not C x C linears"
    return _norms_reason(m.group_norm)


def _scale_is_2(scale) -> bool:
    if isinstance(scale, (int, float)):
        return scale == 2
    return isinstance(scale, (tuple, list)) and len(scale) == 2 and all(s == 2 for s in scale)


def comfy_upsample_reason(m) -> str | None:
    if not m.with_conv:
        return "upsample without conv"
    if not _scale_is_2(m.scale_factor):
        return f"upsample scale {m.scale_factor}"
    return conv_static_reason(m.conv, 3, 1)


def diffusers_upsample_reason(m) -> str | None:
    if not m.use_conv or m.use_conv_transpose or m.norm is not None or not m.interpolate:
        return "upsample is not nearest-2x + conv"
    return conv_static_reason(m.conv if m.name == "conv" else m.Conv2d_0, 3, 1)


def _children_reason(pairs) -> str | None:
    """The fused decoder calls its children with the stock calls of these classes only."""
    for module, expected in pairs:
        if stock_class_name(module) not in expected:
            return f"decoder child {type(module).__name__} is not {expected[0].rsplit('.', 1)[1]}"
    return None


def comfy_decoder_reason(d) -> str | None:
    if not isinstance(d.conv_in, torch.nn.Conv2d):
        return "3-D (video) KL decoder"
    if getattr(d, "give_pre_end", False) or getattr(d, "carried", False):
        return "decoder variant (give_pre_end / carried convs)"
    pairs = [(d.mid.block_1, (COMFY_RESNET,)), (d.mid.attn_1, (COMFY_ATTN,)),
             (d.mid.block_2, (COMFY_RESNET,))]
    for i_level, level in enumerate(d.up):
        if len(level.attn) not in (0, len(level.block)):
            return "decoder layout differs"
        pairs += [(b, (COMFY_RESNET,)) for b in level.block]
        pairs += [(a, (COMFY_ATTN,)) for a in level.attn]
        if i_level != 0:
            pairs.append((level.upsample, (COMFY_UPSAMPLE,)))
    reason = _children_reason(pairs)
    if reason is not None:
        return reason
    return first_reason(_norms_reason(d.norm_out), conv_static_reason(d.conv_in, 3, 1),
                        conv_static_reason(d.conv_out, 3, 1))


def diffusers_decoder_reason(d) -> str | None:
    if not isinstance(d.conv_norm_out, torch.nn.GroupNorm):
        return "spatial norm decoder"
    if not isinstance(d.conv_act, torch.nn.SiLU):
        return f"activation {type(d.conv_act).__name__}"
    if stock_class_name(d.mid_block) != DIFFUSERS_MID_BLOCK:
        return f"mid block {type(d.mid_block).__name__}"
    for up in d.up_blocks:
        if stock_class_name(up) != DIFFUSERS_UP_BLOCK:
            return f"up block {type(up).__name__}"
    mid = d.mid_block
    pairs = [(r, (DIFFUSERS_RESNET,)) for r in mid.resnets]
    pairs += [(a, (DIFFUSERS_ATTENTION,)) for a in mid.attentions if a is not None]
    for up in d.up_blocks:
        pairs += [(r, (DIFFUSERS_RESNET,)) for r in up.resnets]
        pairs += [(u, (DIFFUSERS_UPSAMPLE,)) for u in (up.upsamplers or ())]
    reason = _children_reason(pairs)
    if reason is not None:
        return reason
    return first_reason(_norms_reason(d.conv_norm_out), conv_static_reason(d.conv_in, 3, 1),
                        conv_static_reason(d.conv_out, 3, 1))


# stock class name -> (reason function, fused mixin, norm attributes to swap)
_BLOCKS = {
    COMFY_RESNET: (comfy_resnet_reason, FusedComfyResnetBlock, ("norm1", "norm2")),
    COMFY_ATTN: (comfy_attn_reason, FusedComfyAttnBlock, ("norm",)),
    COMFY_UPSAMPLE: (comfy_upsample_reason, FusedComfyUpsample, ()),
    DIFFUSERS_RESNET: (diffusers_resnet_reason, FusedDiffusersResnetBlock2D, ("norm1", "norm2")),
    DIFFUSERS_ATTENTION: (diffusers_attention_reason, FusedDiffusersAttention, ("group_norm",)),
    DIFFUSERS_UPSAMPLE: (diffusers_upsample_reason, FusedDiffusersUpsample2D, ()),
}
_DECODERS = {
    COMFY_DECODER: (comfy_decoder_reason, FusedComfyDecoder, ("norm_out",)),
    DIFFUSERS_DECODER: (diffusers_decoder_reason, FusedDiffusersDecoder, ("conv_norm_out",)),
}


def _fuse(module, mixin, norm_names, gate) -> str | None:
    """Swap ``mixin`` (and ``FusedGroupNormSiLU`` onto its norms) into ``module``.

    Already-fused modules count as fused (installing twice changes nothing).
    """
    for norm in [getattr(module, n) for n in norm_names]:
        reason = swap_reason(norm, FusedGroupNormSiLU, _fvd_gate=gate)
        if reason is not None:
            return f"norm {reason}"
    return swap_reason(module, mixin, _fvd_gate=gate)


def _try(module, path, table, gate, report: InstallReport) -> None:
    check, mixin, norm_names = table[stock_class_name(module)]
    try:
        reason = check(module)
    except AttributeError as exc:  # a newer tree renamed something: leave it stock
        reason = f"unrecognised layout ({exc})"
    report.record(path, reason or _fuse(module, mixin, norm_names, gate))


def install(model: torch.nn.Module, gate, report: InstallReport) -> None:
    decoder = kl_decoder(model)
    if decoder is None:
        report.reason = f"unsupported VAE ({type(model).__name__})"
        return
    prefix = "" if decoder is model else "decoder"
    if stock_class_name(decoder) == COMFY_DECODER and not isinstance(decoder.conv_in, torch.nn.Conv2d):
        report.reason = "3-D (video) KL decoder: not supported"
        return
    for name, module in decoder.named_modules():
        if module is not decoder and stock_class_name(module) in _BLOCKS:
            _try(module, f"{prefix}.{name}".strip("."), _BLOCKS, gate, report)
    _try(decoder, prefix or "decoder", _DECODERS, gate, report)


register_family(Family("kl", matches, install))
