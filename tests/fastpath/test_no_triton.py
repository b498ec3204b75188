"""No Triton (Windows without triton-windows, macOS, CPU-only installs): the pack loads, high
decodes exactly like stock, and the reason is one line. Triton is hidden in a subprocess with
``sys.modules["triton"] = None``, which makes every ``import triton`` fail as it would there.

Tier 1. (The same in ComfyUI, every node, is tier 2, in tests/comfyui/test_no_triton_comfyui.py.)"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
sys.modules["triton"] = None
spec = importlib.util.spec_from_file_location(
    "fast_vae_decode", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]])
pkg = importlib.util.module_from_spec(spec); sys.modules["fast_vae_decode"] = pkg
spec.loader.exec_module(pkg)
import torch
from fast_vae_decode.bench.models import diffusers_vae, seeded_latent
from fast_vae_decode.fastpath.quality import decode_at_quality
model = diffusers_vae("sdxl", seed=0, tiny=True)
z = seeded_latent((1, 4, 6, 6), seed=1)
with torch.inference_mode():
    lossless, a = decode_at_quality(model, "lossless", lambda: model.decode(z).sample)
    high, b = decode_at_quality(model, "high", lambda: model.decode(z).sample)
print(json.dumps({"equal": torch.equal(lossless, high), "lossless": a.text(), "high": b.text()}))
"""


def test_without_triton_high_is_stock_and_says_why(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")  # even the interpreter needs Triton itself
    # Run from an empty folder: ``-c`` puts the working directory on sys.path, and the
    # checkout's ``kernels/`` would shadow the installed one that transformers imports.
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], env=env, capture_output=True,
                         text=True, timeout=300, check=True, cwd=tmp_path)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["equal"]
    assert result["lossless"] == "lossless"
    assert result["high"].startswith("fallback: no Triton (")
    assert "\n" not in result["high"]
