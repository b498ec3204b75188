"""The high decode through the loaded pack's node, shared by the unload/reload tests
(tests/comfyui/test_comfyui_gpu_lifecycle.py, tier 2, and test_comfyui_gpu_lifecycle_gpu.py,
tier 3)."""
from __future__ import annotations


def _high(pack, vae, z):
    out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality="high")
    return out.args[0], out.ui["fast_vae_decode"][0]
