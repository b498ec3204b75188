"""Tier 2: the tiled node against ComfyUI's "VAE Decode (Tiled)", and the out-of-memory retry
inside ``vae.decode`` keeping the chosen quality."""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui, pytest.mark.usefixtures("no_interpreter")]

TILED_INPUTS = dict(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)


@pytest.fixture(scope="module")
def vaes():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    # Narrow widths (same architecture and key names): ComfyUI's tiled decode runs each image
    # three times with different tile shapes, which is minutes at full width on CI's CPUs.
    return {"sdxl": comfy_vae("sdxl", seed=0, tiny=True), "wan21": comfy_vae("wan21", seed=0, tiny=True)}


# Latents several tiles wide so tiling (and the tile blending) really happens.
@pytest.mark.parametrize("arch,shape", [("sdxl", (1, 4, 16, 12)), ("wan21", (1, 16, 2, 10, 8))])
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_tiled_node_equals_vae_decode_tiled(pack, vaes, arch, shape, quality):
    vae = vaes[arch]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = comfy_nodes().VAEDecodeTiled().decode(vae, {"samples": z}, **TILED_INPUTS)[0]
        out = pack["FastVAEDecodeTiled"].execute(samples={"samples": z}, vae=vae, quality=quality,
                                                 **TILED_INPUTS)
    assert torch.equal(out.args[0], expected)
    assert out.ui["fast_vae_decode"][0]["quality"] == quality


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_out_of_memory_retry_keeps_the_quality(pack, vaes, monkeypatch, quality):
    """vae.decode retries tiled after an OOM; the retry must run inside the same gate state."""
    import comfy.model_management as mm

    vae = vaes["sdxl"]
    model = vae.first_stage_model
    gate = pack_module("fastpath.gate").gate_for(model)
    seen = []

    def decode_oom_then_blank(z, **kwargs):
        seen.append(gate.is_open)
        if len(seen) == 1:
            raise mm.OOM_EXCEPTION("simulated out of memory")
        return torch.zeros(z.shape[0], 3, z.shape[2] * 8, z.shape[3] * 8, dtype=z.dtype)

    monkeypatch.setattr(model, "decode", decode_oom_then_blank)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the gate open on a CPU-only machine
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)
    assert out.args[0].shape == (1, 64, 64, 3)
    assert len(seen) > 1 and set(seen[1:]) == {quality == "high"}
    assert not gate.is_open
