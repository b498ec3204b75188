"""The V3 extension ComfyUI's custom-node loader gets from ``comfy_entrypoint``."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .fast_vae_decode import FastVAEDecode
from .fast_vae_decode_tiled import FastVAEDecodeTiled
from .wan_precision import WanVAEDecodePrecision


def start_background_setup() -> None:
    """Triton's one-time set-up, started at ComfyUI's start-up on the device ComfyUI decodes on
    (``fastpath.prewarm.start_triton_setup``); never on a CPU-only ComfyUI (``--cpu``), where
    a CUDA context would only cost VRAM. Best effort: the first fast decode does it otherwise."""
    try:
        import comfy.model_management as mm

        from ..fastpath.prewarm import start_triton_setup

        start_triton_setup(mm.get_torch_device())
    except Exception:  # never stop ComfyUI from loading the pack
        pass


class FastVAEDecodeExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [FastVAEDecode, FastVAEDecodeTiled, WanVAEDecodePrecision]
