"""Which LTX video-VAE code a ComfyUI tree carries (``comfy.ldm.lightricks.vae``), as facts the
LTX family asks for. Known by fingerprint (the names a method's code references and its
parameters), never by version string; code with another fingerprint is not known and the family
keeps it stock.

Kinds met so far:
- 0.8: each module computes its whole input at once. ``CausalConv3d`` pads time by repeating
  the first frame in front (and the last frame behind, non-causal); ``ResnetBlock3D`` and a
  residual ``DepthToSpaceUpsample`` add their residual directly.
- 0.33: the decoder may split its activations into chunks of frames (``Decoder.run_up``) and
  every module keeps per-thread state between chunks in ``temporal_cache_state``: a causal conv
  the frames it still needs (its time kernel less one), with an "ended" flag the decoder sets
  before the last chunk (``mark_conv3d_ended``) that brings in the trailing padding; a residual
  block the residual frames its conv outputs have not reached yet (the convs lag one frame
  each per chunk); ``DepthToSpaceUpsample`` that residual plus whether the first frame has
  been dropped yet. ``Decoder.forward`` clears the state when a decode ends.

  Its ``Decoder.run_up`` also writes each output of the head conv (``conv_out``), unpatchified
  (which keeps the frame count), into the decode's output buffer at a running offset before
  the head conv runs again (``OUTPUT_IN_ORDER``).

``CausalDiffusionVAE`` (``na_diffusion_decoder``, LTX 2.4/2.5, 0.33+) is a different decoder
altogether (a diffusion decoder); the family recognises it only to say it is not supported.
"""
from __future__ import annotations

import functools

from ..swap import stock_class

VAE_MODULE = "comfy.ldm.lightricks.vae.causal_video_autoencoder"
CONV_MODULE = "comfy.ldm.lightricks.vae.causal_conv3d"
NORM_MODULE = "comfy.ldm.lightricks.vae.pixel_norm"
EMBED_MODULE = "comfy.ldm.lightricks.model"

VIDEO_VAE = f"{VAE_MODULE}.VideoVAE"
DIFFUSION_VAE = "comfy.ldm.lightricks.vae.na_diffusion_decoder.CausalDiffusionVAE"
CAUSAL_CONV = f"{CONV_MODULE}.CausalConv3d"
RESNET_BLOCK = f"{VAE_MODULE}.ResnetBlock3D"
DECODER = f"{VAE_MODULE}.Decoder"
DEPTH_TO_SPACE = f"{VAE_MODULE}.DepthToSpaceUpsample"
PIXEL_NORM = f"{NORM_MODULE}.PixelNorm"

# How a module treats frames across calls: WHOLE (one call sees all frames) or CHUNKED
# (per-thread ``temporal_cache_state`` carries frames to the next chunk of the same decode).
WHOLE = "whole"
CHUNKED = "chunked"
# How the decoder hands its frames out: into its output buffer, in order, one head-conv output
# at a time.
OUTPUT_IN_ORDER = "output in order"


def _key(names: set[str], params: tuple[str, ...]) -> tuple[frozenset, tuple]:
    return frozenset(names), ("self",) + params


_STATE = {"get", "get_ident", "temporal_cache_state", "threading"}
_BLOCK = {"_feed_spatial_noise", "conv1", "conv2", "conv_shortcut", "device", "dropout", "dtype",
          "inject_noise", "non_linearity", "norm1", "norm2", "norm3", "per_channel_scale1",
          "per_channel_scale2", "reshape", "scale_shift_table", "shape", "timestep_conditioning",
          "to", "unbind"}
_D2S = {"conv", "math", "out_channels_reduction_factor", "prod", "rearrange", "repeat", "residual",
        "stride"}

# (stock class, method) -> {fingerprint: how it treats frames}
KNOWN: dict[tuple[str, str], dict[tuple[frozenset, tuple], str]] = {
    (CAUSAL_CONV, "forward"): {
        _key({"concatenate", "conv", "repeat", "time_kernel_size", "torch"}, ("x", "causal")): WHOLE,
        _key(_STATE | {"_empty_output", "append", "cat", "conv", "repeat", "shape", "sum",
                       "time_kernel_size", "time_stride", "torch"}, ("x", "causal")): CHUNKED,
    },
    (RESNET_BLOCK, "forward"): {
        _key(_BLOCK, ("input_tensor", "causal", "timestep")): WHOLE,
        _key(_BLOCK | _STATE | {"add_exchange_cache"}, ("input_tensor", "causal", "timestep")): CHUNKED,
    },
    (DEPTH_TO_SPACE, "forward"): {
        _key(_D2S, ("x", "causal", "timestep")): WHOLE,
        _key(_D2S | _STATE | {"add_exchange_cache", "shape"}, ("x", "causal", "timestep")): CHUNKED,
    },
    (PIXEL_NORM, "forward"): {
        _key({"dim", "eps", "mean", "sqrt", "torch"}, ("x",)): WHOLE,
    },
    (DECODER, "run_up"): {
        _key({"UNetMidBlock3D", "causal", "chunk", "conv_act", "conv_norm_out", "conv_out", "copy_",
              "element_size", "enumerate", "isinstance", "len", "mark_conv3d_ended", "numel",
              "patch_size", "run_up", "shape", "timestep_conditioning", "torch", "unpatchify",
              "up_blocks"},
             ("idx", "sample_ref", "ended", "timestep_shift_scale", "scaled_timestep",
              "checkpoint_fn", "output_buffer", "output_offset", "max_chunk_size")): OUTPUT_IN_ORDER,
    },
}


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def frames_rule(module: object) -> str | None:
    """WHOLE / CHUNKED for a known stock ``forward`` of ``module``; None when not known code."""
    return _rule(stock_class(module), "forward")


def writes_output_in_order(decoder: object) -> bool:
    """Whether ``decoder`` (a ``Decoder``) is the known code that writes each head-conv output
    into its output buffer, in order, before running the head conv again."""
    return _rule(stock_class(decoder), "run_up") == OUTPUT_IN_ORDER


@functools.lru_cache(maxsize=None)
def _rule(cls: type, method: str) -> str | None:
    table = KNOWN.get((qualified(cls), method))
    code = getattr(getattr(cls, method, None), "__code__", None)
    if table is None or code is None:
        return None
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return table.get((frozenset(code.co_names), params))


def forward_reason(module: object) -> str | None:
    """Why the family may not stand in for ``module``: its stock forward is code it has not seen."""
    if frames_rule(module) is not None:
        return None
    return f"unrecognised {qualified(stock_class(module))}.forward (a newer version?)"
