"""The LTX family on a GPU at LTX-2's real widths and frame size (tier 3: ``cuda`` and
``COMFYUI_PATH``).

ComfyUI's default LTX-2 ``VideoVAE`` (seeded random weights, ComfyUI's own dtype), a 768x512
latent of 3 frames (17 output frames), through the pack's node against ``VAEDecode``, each
decode seeded (the decode draws noise). The CPU tier is test_ltx_comfy.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from support.comfy_env import comfy_nodes, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui, pytest.mark.cuda]

SHAPE = (1, 128, 3, 16, 24)


def _psnr(a, b) -> float:
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def vae():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return comfy_vae("ltx2", seed=0)


def _seeded(fn, *args, **kwargs):
    torch.manual_seed(0)
    return fn(*args, **kwargs)


def test_real_size_lossless_exact_high_fused_and_close(pack, vae):
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = _seeded(comfy_nodes().VAEDecode().decode, vae, {"samples": z})[0]
        lossless = _seeded(pack["FastVAEDecode"].execute, samples={"samples": z}, vae=vae,
                           quality="lossless")
        high = _seeded(pack["FastVAEDecode"].execute, samples={"samples": z}, vae=vae, quality="high")
    assert expected.shape == (17, 512, 768, 3)
    assert torch.equal(lossless.args[0], expected)
    text = high.ui["text"][0]
    assert text.startswith("high: ") and "stock calls" not in text, text
    images = high.args[0]
    assert torch.isfinite(images).all()
    # bf16 decodes of random weights: stock and high differ by roundings only.
    assert _psnr(images, expected) > 30, _psnr(images, expected)
