"""Decode precision for Wan VAEs: a new VAE object whose decoder runs at another dtype.

The VAE given is never changed, so every other node that uses it decodes exactly as before.

For a ``comfy.sd.VAE`` the result is a shallow copy of the wrapper with its own model and its
own ``ModelPatcher``:
- the model is an independent copy (``module_clone``): decoder and post-quant conv (``conv2``
  in ComfyUI, ``post_quant_conv`` in diffusers) in the chosen dtype, encoder and quant conv in
  fp32, made on the patcher's offload device (where ComfyUI keeps an unloaded model); sharing
  tensors with the original would let either patcher move the other's weights;
- the patcher is a new one of the same class, so ComfyUI's model management loads, offloads and
  frees the copy like any model, and the copy's memory goes with the returned VAE;
- ``vae_dtype`` (what ``VAE.decode``/``encode`` cast their inputs to) becomes fp32: images reach
  the fp32 encoder unrounded, and the model casts latents to the decoder's dtype itself
  (``wan_decode``), which is the cast ``VAE.decode`` would have done; the decode memory estimate
  is asked at the decoder's dtype.

An ``nn.Module`` (diffusers ``AutoencoderKLWan`` or a bare ComfyUI ``WanVAE``) gives a new
module made the same way, on the device its weights are on.
"""
from __future__ import annotations

import copy

import torch

from ...gate import decoder_models
from ...module_clone import clone_module, tensor_copier
from ...recognize import is_wan_vae_model
from .decode import decoder_side, install_decode_loop

PRECISIONS = ("fp32", "fp16", "bf16")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ENCODER_DTYPE = torch.float32


def check_wan_vae(vae: object) -> None:
    models = decoder_models(vae)
    if not models or not is_wan_vae_model(models[0]):
        got = type(models[0]).__name__ if models else type(vae).__name__
        raise ValueError(
            "Wan VAE Decode Precision needs a Wan VAE (Wan 2.1, Wan 2.2 or Qwen-Image); "
            f"got a {got} VAE")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return precision


def _weights_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def precision_model(model: torch.nn.Module, dtype: torch.dtype,
                    device: torch.device | str) -> torch.nn.Module:
    """A copy of the Wan ``model`` on ``device``: decoder side in ``dtype``, the rest fp32."""
    side = decoder_side(model)

    def dtype_for(path: str) -> torch.dtype:
        return dtype if path.split(".", 1)[0] in side else ENCODER_DTYPE

    new = clone_module(model, tensor_copier(device, dtype_for))
    install_decode_loop(new)
    new.__dict__["_fvd_decoder_dtype"] = dtype
    new.__dict__["_fvd_encoder_dtype"] = ENCODER_DTYPE
    return new


def _new_patcher(patcher, model: torch.nn.Module):
    """A patcher like ``patcher`` (same class, devices) for ``model``, as ``comfy.sd.VAE`` makes one."""
    try:
        return type(patcher)(model, load_device=patcher.load_device,
                             offload_device=patcher.offload_device)
    except TypeError as exc:
        raise RuntimeError(
            f"Wan VAE Decode Precision cannot make a {type(patcher).__name__} for the new VAE "
            f"(this ComfyUI version builds it differently: {exc})") from exc


def with_decoder_precision(vae: object, precision: str) -> object:
    """A Wan VAE like ``vae`` whose decoder runs in ``precision`` (encoder stays fp32)."""
    dtype = DTYPES[check_precision(precision)]
    check_wan_vae(vae)
    model = decoder_models(vae)[0]
    if model is vae:
        return precision_model(model, dtype, _weights_device(model))

    patcher = getattr(vae, "patcher", None)
    device = getattr(patcher, "offload_device", None) or _weights_device(model)
    new_model = precision_model(model, dtype, device)
    new = copy.copy(vae)
    for key in [k for k in vars(new) if k.startswith("_fvd")]:  # fast-path state of the original
        delattr(new, key)
    new.first_stage_model = new_model
    if patcher is not None:
        new.patcher = _new_patcher(patcher, new_model)
    new.vae_dtype = torch.float32
    estimate = getattr(vae, "memory_used_decode", None)
    if callable(estimate):
        new.memory_used_decode = lambda shape, _dtype, _estimate=estimate: _estimate(shape, dtype)
    if "size" in vars(new):  # 0.8.0 caches the model's size on the wrapper
        new.size = None
    return new
