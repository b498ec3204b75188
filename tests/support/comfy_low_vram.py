"""Latents, stock and fast node decodes, and ComfyUI's offload marks, shared by the low-VRAM
tests (tests/comfyui/test_comfyui_low_vram.py, tier 2, and test_comfyui_low_vram_gpu.py,
tier 3)."""
from __future__ import annotations

import torch

from support.comfy_env import comfy_nodes

LATENT = (1, 4, 4, 4)  # 32x32 px: each interpreted high decode of the tiny VAE takes seconds


def _latent(shape=LATENT, seed=1, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _stock_node(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def _fast_node(pack, vae, z, quality):
    out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)
    return out.args[0], out.ui["fast_vae_decode"][0]


def _mark_offloaded(module: torch.nn.Module) -> None:
    """What ComfyUI's ``ModelPatcher.load`` sets on a module it leaves offloaded."""
    module.prev_comfy_cast_weights = module.comfy_cast_weights
    module.comfy_cast_weights = True
    module.weight_function = []
    module.bias_function = []


def _ops_leaves(root: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in root.modules() if hasattr(m, "comfy_cast_weights")]
