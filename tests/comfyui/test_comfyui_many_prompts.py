"""Tier 2: a headless server takes 50 API-format prompts that use the pack; all complete with
correct images and no gate is left open (a stock VAEDecode in every prompt stays exact).

The server runs with ``TRITON_INTERPRET=1`` so that on a CPU-only machine ``high`` really opens
the gate and runs the fused kernels (in the interpreter): a gate left open would then change
the stock decodes that follow it.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from support.comfy_env import comfy_nodes, requires_comfyui
from support.comfy_server import ComfyServer, add_vae_file, as_saved, saved_png

pytestmark = [requires_comfyui, pytest.mark.comfyui]

VAE_FILE = "fvd_many_sdxl.safetensors"
N_PROMPTS = 50


def _prompt(i: int) -> dict:
    # Every prompt differs in size or quality, so ComfyUI's cache cannot skip a decode.
    width, height = 32 + 8 * (i % 25), 32 if i < 25 else 40
    quality = "high" if i % 5 == 0 else "lossless"
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "3": {"class_type": "FastVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0], "quality": quality}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": f"fast_{i}"}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": f"stock_{i}"}},
    }


def test_fifty_prompts(tmp_path):
    nodes = comfy_nodes()
    server = ComfyServer(tmp_path)
    vae = add_vae_file(server, VAE_FILE, seed=7)
    server.start(env={"TRITON_INTERPRET": "1"})
    try:
        start = time.monotonic()
        ids = [server.post("/prompt", {"prompt": _prompt(i)})["prompt_id"] for i in range(N_PROMPTS)]
        entries = [server.wait(pid, timeout=900) for pid in ids]
        wall = time.monotonic() - start
    finally:
        server.stop()
    print(f"{N_PROMPTS} prompts in {wall:.1f} s")
    failures = []
    for i, entry in enumerate(entries):
        prompt = _prompt(i)
        width, height = prompt["2"]["inputs"]["width"], prompt["2"]["inputs"]["height"]
        z = torch.zeros(1, 4, height // 8, width // 8)
        with torch.inference_mode():
            expected = as_saved(nodes.VAEDecode().decode(vae, {"samples": z})[0])
        stock, fast = saved_png(server, entry, "6"), saved_png(server, entry, "4")
        text = entry["outputs"]["3"]["text"][0]
        # Separate processes may split CPU reductions differently: allow one 8-bit step.
        if np.abs(stock.astype(int) - expected).max() > 1:
            failures.append(f"prompt {i}: stock VAEDecode changed")
        if prompt["3"]["inputs"]["quality"] == "lossless":
            if np.abs(fast.astype(int) - expected).max() > 1 or text != "lossless":
                failures.append(f"prompt {i}: lossless differs ({text})")
        elif not text.startswith("high") or np.abs(fast.astype(int) - expected).max() > 2:
            failures.append(f"prompt {i}: high {text}")
    assert not failures, failures
