"""Decode precision for Wan VAEs: a new VAE object whose decoder runs at another dtype.

The VAE given is never changed, so every other node that uses it decodes exactly as before.
"""
from __future__ import annotations

from .gate import decoder_models
from .recognize import is_wan_vae_model

PRECISIONS = ("fp32", "fp16", "bf16")


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


def with_decoder_precision(vae: object, precision: str) -> object:
    """A Wan VAE like ``vae`` whose decoder runs in ``precision`` (encoder stays fp32)."""
    check_precision(precision)
    check_wan_vae(vae)
    raise NotImplementedError("decode precision lands with the Wan fast path")
