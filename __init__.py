"""Fast VAE Decode for ComfyUI: gated fused VAE decoders, bit-exact when asked.

The repository root is both the ComfyUI custom-node package and the importable Python package
``fast_vae_decode``. Importing it never needs ComfyUI; ComfyUI finds ``comfy_entrypoint``.
"""
from __future__ import annotations

__version__ = "0.3.0"

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI's V3 entry point, called once at start-up by every tree's loader; the node layer
    imports ``comfy_api`` only from here."""
    from .nodes.extension import FastVAEDecodeExtension, start_background_setup

    start_background_setup()
    return FastVAEDecodeExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY", "__version__"]
