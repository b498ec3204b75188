"""Tier 2: the pack inside a real ComfyUI tree, against ComfyUI's own VAEDecode.

Runs under ``torch.inference_mode()`` as ComfyUI's executor does. On a machine without a GPU the
``high`` quality takes the stock path (CPU tensors), so it too must be ``torch.equal`` with
VAEDecode here; the fast path itself is compared with lossless in the GPU tier.
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui, pytest.mark.usefixtures("no_interpreter")]

# (architecture, latent shape): one image VAE and one video VAE, as the foundation issue asks.
CASES = [
    ("sdxl", (1, 4, 8, 8)),
    ("wan21", (1, 16, 2, 4, 6)),  # 2 latent frames -> 5 video frames, flattened to images
]


@pytest.fixture(scope="module")
def vaes():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return {arch: comfy_vae(arch, seed=0) for arch, _ in CASES}


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stock(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def test_pack_registers_both_nodes_through_comfyuis_loader(pack):
    nodes = comfy_nodes()
    assert "FastVAEDecode" in pack and "WanVAEDecodePrecision" in pack
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["FastVAEDecode"] == "Fast VAE Decode (quality)"
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["WanVAEDecodePrecision"] == "Wan VAE Decode Precision"
    schema = pack["FastVAEDecode"].GET_SCHEMA()
    assert [i.id for i in schema.inputs] == ["samples", "vae", "quality"]


@pytest.mark.parametrize("arch,shape", CASES)
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_fast_vae_decode_equals_vae_decode(pack, vaes, arch, shape, quality):
    vae, z = vaes[arch], _latent(shape)
    with torch.inference_mode():
        expected = _stock(vae, z)
        out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)
        images = out.args[0]
        assert images.shape == expected.shape and images.ndim == 4
        assert torch.equal(images, expected)
        assert torch.equal(_stock(vae, z), expected)  # stock stays exact after the pack ran
    text = out.ui["text"][0]
    assert text == "lossless" if quality == "lossless" else text.startswith(("high", "fallback"))


def test_high_on_cpu_says_why(pack, vaes):
    with torch.inference_mode():
        out = pack["FastVAEDecode"].execute(samples={"samples": _latent((1, 4, 8, 8))},
                                            vae=vaes["sdxl"], quality="high")
    if not torch.cuda.is_available():
        assert out.ui["text"][0] == "fallback: no CUDA device"


@pytest.mark.parametrize("bad,match", [
    ({"samples": torch.zeros(1, 16, 8, 8)}, "expects latents with 4 channels; got 16"),
    ({"latent": torch.zeros(1, 4, 8, 8)}, "expected a LATENT dict with a 'samples' tensor"),
])
def test_bad_latent_is_a_clear_error_and_changes_nothing(pack, vaes, bad, match):
    vae, z = vaes["sdxl"], _latent((1, 4, 8, 8))
    with torch.inference_mode():
        expected = _stock(vae, z)
        with pytest.raises(ValueError, match=match):
            pack["FastVAEDecode"].execute(samples=bad, vae=vae, quality="high")
        assert torch.equal(_stock(vae, z), expected)


def test_unknown_quality_is_a_clear_error(pack, vaes):
    vae, z = vaes["sdxl"], _latent((1, 4, 8, 8))
    with torch.inference_mode():
        expected = _stock(vae, z)
        with pytest.raises(ValueError, match="quality must be one of high, lossless; got 'best'"):
            pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality="best")
        assert torch.equal(_stock(vae, z), expected)


def test_precision_node_refuses_a_non_wan_vae(pack, vaes):
    with pytest.raises(ValueError, match="needs a Wan VAE .*got a .* VAE"):
        pack["WanVAEDecodePrecision"].execute(vae=vaes["sdxl"], precision="bf16")


def test_unload_all_models_fires_the_hook(pack, vaes):
    import comfy.model_management as mm

    vae, z = vaes["sdxl"], _latent((1, 4, 8, 8))
    with torch.inference_mode():
        pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality="high")
    model = vae.first_stage_model
    # Plant a cache entry where a fast decode would have built one (CPU runs build none).
    fused = next(m for m in model.modules() if type(m).__dict__.get("_fvd_stock_class"))
    fused.__dict__["_fvd_cache"] = {"planted": ((), torch.zeros(4))}
    with torch.inference_mode():
        _stock(vae, z)  # loads the patcher so ComfyUI knows the model is loaded
    mm.unload_all_models()
    assert "_fvd_cache" not in fused.__dict__


def test_start_up_sets_triton_up_only_for_a_cuda_device(pack, monkeypatch):
    """ComfyUI's loader calls the pack's entry point at start-up; Triton's driver and key are
    set up then, on the device ComfyUI decodes on, and never for a CPU ComfyUI."""
    import comfy.model_management as mm

    from support.comfy_env import pack_module

    backend, extension = pack_module("kernels.backend"), pack_module("nodes.extension")
    if backend.triton is None:
        pytest.skip("needs Triton")
    if mm.get_torch_device().type == "cpu":  # what the loader's own call found here
        assert "thread" not in backend._COMPILER_KEY
    calls = []
    monkeypatch.setattr(backend, "_COMPILER_KEY", {})
    monkeypatch.setattr(backend, "_set_up_compiler", lambda: calls.append("set up"))
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cpu"))
    extension.start_background_setup()
    assert calls == [] and backend._COMPILER_KEY == {}
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cuda", 0))
    extension.start_background_setup()
    backend._COMPILER_KEY["thread"].join()
    assert calls == ["set up"]
