"""The V3 extension ComfyUI's custom-node loader gets from ``comfy_entrypoint``."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .fast_vae_decode import FastVAEDecode
from .fast_vae_decode_tiled import FastVAEDecodeTiled
from .wan_precision import WanVAEDecodePrecision


class FastVAEDecodeExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [FastVAEDecode, FastVAEDecodeTiled, WanVAEDecodePrecision]
