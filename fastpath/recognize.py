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


def unknown_module(root, known: frozenset | set, torch_safe: tuple, prefix: str = "decoder") -> str | None:
    """The first module under ``root`` whose stock class is neither in ``known`` (qualified
    names) nor a subclass of one of ``torch_safe``, as a reason; None when all are known."""
    for path, m in root.named_modules(prefix=prefix):
        name = stock_class_name(m)
        if name in known or is_a(m, *torch_safe):
            continue
        return f"unknown module {name} at {path}"
    return None
