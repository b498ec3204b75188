"""One VAE, several nodes in one prompt: FastVAEDecode high, FastVAEDecode lossless and
ComfyUI's own VAEDecode all decode the same latent with the same VAE object (tier 2).

Each gets its own behaviour: high runs the fused modules, lossless and the stock node run the
stock computation bit for bit, whatever ran before them in the prompt. The fast path runs on
CPU tensors under ``TRITON_INTERPRET=1`` (set for the server process too), so a gate left open
by the high node would change the stock decodes after it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui
from support.comfy_server import ComfyServer, add_vae_file, as_saved, saved_png

pytestmark = [requires_comfyui, pytest.mark.comfyui]

# fp32 on the CPU, fast vs stock: a few ULPs compounded over the decoder's layers measure
# ~4e-6 of the output range; 1e-4 still catches a wrong layer or a stale gate.
REL_TOL = 1e-4


def _rel_err(a, b):
    return ((a - b).abs().max() / (b.max() - b.min())).item()


def test_in_process_each_node_keeps_its_behaviour(pack, monkeypatch):
    from fast_vae_decode.bench.models import comfy_vae

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    nodes = comfy_nodes()
    vae = comfy_vae("sdxl", seed=0, tiny=True)
    gate = pack_module("fastpath.gate").gate_for(vae.first_stage_model)
    latent = {"samples": torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))}

    def stock():
        return nodes.VAEDecode().decode(vae, latent)[0]

    def fast(quality):
        out = pack["FastVAEDecode"].execute(samples=latent, vae=vae, quality=quality)
        assert not gate.is_open
        return out.args[0], out.ui["text"][0]

    # The order a prompt may run them in: stock first, the fast nodes, stock again, then the
    # fast nodes the other way round with the stock node between them.
    with torch.inference_mode():
        first = stock()
        high, high_text = fast("high")
        lossless, lossless_text = fast("lossless")
        after_high = stock()
        lossless_again, _ = fast("lossless")
        between = stock()
        high_again, _ = fast("high")
        last = stock()
    for out in (lossless, after_high, lossless_again, between, last):
        assert torch.equal(out, first)
    assert high_text.startswith("high:") and lossless_text == "lossless"
    assert _rel_err(high, first) < REL_TOL and torch.equal(high_again, high)
    assert not torch.equal(high, first)  # high really took the fast path here


# --- the same through a headless server, one API prompt ------------------------------------

VAE_FILE = "fvd_shared_sdxl.safetensors"
LATENT_FILE = "fvd_shared.latent"


def _prompt() -> dict:
    vae, latent = ["1", 0], ["2", 0]
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": LATENT_FILE}},
        "3": {"class_type": "FastVAEDecode", "inputs": {"samples": latent, "vae": vae, "quality": "high"}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "high"}},
        "5": {"class_type": "FastVAEDecode", "inputs": {"samples": latent, "vae": vae, "quality": "lossless"}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "lossless"}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": latent, "vae": vae}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "stock"}},
    }


def test_one_prompt_through_the_server(tmp_path):
    from safetensors.torch import save_file

    nodes = comfy_nodes()
    server = ComfyServer(tmp_path)
    # The latent stays tiny (32x32 px): the interpreter runs high on the CPU, slowly.
    vae = add_vae_file(server, VAE_FILE, seed=7)
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    # LoadLatent scales latents without this marker key by 1/0.18215.
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])},
              str(tmp_path / "input" / LATENT_FILE))
    server.start(env={"TRITON_INTERPRET": "1"})
    try:
        entry = server.run_prompt(_prompt(), timeout=900)
    finally:
        server.stop()
    with torch.inference_mode():
        expected = as_saved(nodes.VAEDecode().decode(vae, {"samples": z})[0])
    high, lossless, stock = (saved_png(server, entry, n).astype(int) for n in ("4", "6", "8"))
    assert entry["outputs"]["3"]["text"][0].startswith("high:"), entry["outputs"]["3"]
    assert entry["outputs"]["5"]["text"][0] == "lossless"
    # In one process the stock node and lossless run the same computation: equal bytes.
    assert np.array_equal(lossless, stock)
    # Separate processes may split CPU reductions differently: allow one 8-bit step.
    assert np.abs(stock - expected).max() <= 1
    # High's float error is ~1e-5 of the range, far below one 8-bit step (4e-3): truncating
    # to 8 bits can still tip a value across a step boundary, by one step at most.
    assert np.abs(high - lossless).max() <= 1
