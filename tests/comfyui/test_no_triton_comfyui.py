"""No Triton (Windows without triton-windows, macOS, CPU-only installs), in ComfyUI.

Tier 2 (``COMFYUI_PATH``): the pack loads through ComfyUI's loader and every node at high
decodes exactly like stock, saying why in one line. Triton is hidden in a subprocess with
``sys.modules["triton"] = None``, which makes every ``import triton`` fail as it would there.
(The pack alone without Triton is tier 1, in tests/fastpath/test_no_triton.py.)"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from support.comfy_env import requires_comfyui

REPO = pathlib.Path(__file__).resolve().parents[2]

COMFY_SCRIPT = r"""
import json, sys
sys.modules["triton"] = None
sys.path.insert(0, sys.argv[1])
import conftest  # maps the checkout to fast_vae_decode, as in the test session
import torch
from support.comfy_env import comfy_nodes, loaded_pack
from fast_vae_decode.bench.models import comfy_vae
nodes = comfy_nodes()
pack = loaded_pack()
vae = comfy_vae("sdxl", seed=0, tiny=True)
z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
with torch.inference_mode():
    stock = nodes.VAEDecode().decode(vae, {"samples": z})[0]
    result = {}
    for name, kwargs in [("FastVAEDecode", {}),
                         ("FastVAEDecodeTiled", dict(tile_size=64, overlap=16, temporal_size=8,
                                                     temporal_overlap=4))]:
        out = pack[name].execute(samples={"samples": z}, vae=vae, quality="high", **kwargs)
        expected = stock if name == "FastVAEDecode" else nodes.VAEDecodeTiled().decode(
            vae, {"samples": z}, **kwargs)[0]
        result[name] = [torch.equal(out.args[0], expected), out.ui["text"][0]]
print(json.dumps(result))
"""


@requires_comfyui
def test_without_triton_the_pack_loads_in_comfyui_and_every_node_works(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    # From an empty folder (``-c`` puts the working directory on sys.path): see test_no_triton.
    out = subprocess.run([sys.executable, "-c", COMFY_SCRIPT, str(REPO / "tests")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (equal, text) in result.items():
        assert equal, name
        assert text.startswith("fallback: no Triton ("), (name, text)
