"""Recognise ComfyUI and diffusers classes by their qualified names, without importing them.

Matching on ``module.QualName`` over the MRO keeps ``fastpath`` importable without ComfyUI or
diffusers and still recognises a module whose class was swapped for a fused subclass.
"""
from __future__ import annotations

from .swap import stock_class

WAN_VAE_CLASSES = (
    "comfy.ldm.wan.vae.WanVAE",  # Wan 2.1, Qwen-Image
    "comfy.ldm.wan.vae2_2.WanVAE",  # Wan 2.2 (48 latent channels)
    "diffusers.models.autoencoders.autoencoder_kl_wan.AutoencoderKLWan",
)


def stock_class_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s own class (its stock class once swapped)."""
    cls = stock_class(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def class_names(obj: object) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}


def is_a(obj: object, *qualified_names: str) -> bool:
    return not class_names(obj).isdisjoint(qualified_names)


def is_wan_vae_model(model: object) -> bool:
    return is_a(model, *WAN_VAE_CLASSES)
