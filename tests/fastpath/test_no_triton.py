"""No Triton (Windows without triton-windows, macOS, CPU-only installs): the pack loads, high
decodes exactly like stock, and the reason is one line. Triton is hidden in a subprocess with
``sys.modules["triton"] = None``, which makes every ``import triton`` fail as it would there."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

from support.comfy_env import requires_comfyui  # noqa: E402

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


def test_without_triton_high_is_stock_and_says_why():
    env = dict(os.environ, TRITON_INTERPRET="1")  # even the interpreter needs Triton itself
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["equal"]
    assert result["lossless"] == "lossless"
    assert result["high"].startswith("fallback: no Triton (")
    assert "\n" not in result["high"]


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
def test_without_triton_the_pack_loads_in_comfyui_and_every_node_works():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMFY_SCRIPT, str(REPO / "tests")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (equal, text) in result.items():
        assert equal, name
        assert text.startswith("fallback: no Triton ("), (name, text)
