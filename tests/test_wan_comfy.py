"""Tier 2: the Wan family and decode precision on ComfyUI's own ``WanVAE`` classes.

``comfy.sd.VAE`` built from seeded random state dicts (``bench.models.comfy_vae``, tiny widths,
detected from the keys as a checkpoint is), decoded through ComfyUI's ``VAEDecode``; runs under
``torch.inference_mode()`` as ComfyUI's executor does. The Triton interpreter stays on (tier 1's
``conftest``), so ``high`` really runs the fused kernels here, on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from comfy_env import comfy_nodes, loaded_pack, requires_comfyui
from fast_vae_decode.fastpath.families.wan.precision import with_decoder_precision
from fast_vae_decode.fastpath.gate import gate_for, gates_opened
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.fastpath.swap import is_swapped
from wan_models import psnr

pytestmark = [requires_comfyui, pytest.mark.comfyui]

# (architecture, latent shape)
CASES = [
    ("wan21", (1, 16, 2, 8, 8)),  # the plain case: first chunk + one steady-state chunk
    ("wan21", (2, 16, 3, 3, 5)),  # batch 2, odd sizes, a third chunk on 2-frame caches
    ("wan21", (1, 16, 1, 4, 6)),  # one latent frame: the loop returns the chunk itself
    ("wan22", (1, 48, 2, 4, 6)),  # Wan 2.2: Up_ResidualBlock, DupUp3D, first_chunk, unpatchify
    ("wan22", (1, 48, 3, 3, 5)),  # Wan 2.2, odd sizes and a third chunk
]
IDS = [f"{a}-{'x'.join(map(str, s))}" for a, s in CASES]
COMFY_DECODER_SIDE = ("decoder.", "conv2.")


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _decode(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


@pytest.fixture(scope="module")
def vaes():
    """Per architecture: a stock VAE and one with the fast path installed (same weights)."""
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    out = {}
    for arch in ("wan21", "wan22"):
        fast = comfy_vae(arch, seed=0, tiny=True)
        report = install_fast_path(fast.first_stage_model)
        out[arch] = (comfy_vae(arch, seed=0, tiny=True), fast, report)
    return out


@pytest.mark.parametrize("arch", ["wan21", "wan22"])
def test_installs_into_comfyuis_wan_vae(vaes, arch):
    _, vae, report = vaes[arch]
    assert report.family == "wan" and report.reason is None and report.skipped == {}
    model = vae.first_stage_model
    assert model._fvd_loop is True  # this tree's WanVAE.decode is a loop we know
    assert all(is_swapped(m) for m in model.decoder.modules()
               if type(m).__name__.endswith(("ResidualBlock]", "CausalConv3d]", "AttentionBlock]")))
    assert not any(is_swapped(m) for m in model.encoder.modules())
    # Every RMS_norm of this tree passed the install-time formula probe: lossless runs them as
    # one exact pass (the fused head norm has the same stock path).
    norms = [m for m in model.decoder.modules() if type(m).__name__.endswith("RMS_norm]")]
    assert norms and all(m._fvd_exact for m in norms)


@pytest.mark.parametrize("arch,shape", CASES, ids=IDS)
def test_lossless_equals_vae_decode(vaes, arch, shape):
    stock, vae, _ = vaes[arch]
    z = _latent(shape)
    with torch.inference_mode():
        expected = _decode(stock, z)
        with gates_opened(vae, False):
            got = _decode(vae, z)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_preallocated_loop_equals_the_trees_own_loop_with_fused_modules(vaes, arch, shape):
    _, vae, _ = vaes[arch]
    model = vae.first_stage_model
    z = _latent(shape)
    with torch.inference_mode(), gate_for(model).opened(True):
        assert torch.equal(model.decode(z), model._fvd_stock_class.decode(model, z))


@pytest.mark.parametrize("arch,shape", CASES, ids=IDS)
def test_high_close_to_lossless(vaes, arch, shape):
    stock, vae, _ = vaes[arch]
    z = _latent(shape)
    with torch.inference_mode():
        expected = _decode(stock, z)
        with gates_opened(vae, True) as stats:
            got = _decode(vae, z)
    assert stats[0].fallbacks == {} and stats[0].fused_calls > 0
    # fp32 on the CPU: reduction order and conv kernels differ at ~1e-7 relative per layer;
    # VAEDecode's images are in [0, 1].
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["wan21", "wan22"])
def test_precision_copy_of_a_comfy_vae(vaes, arch):
    import comfy.model_patcher

    vae, _, _ = vaes[arch]
    z = _latent((1, 16 if arch == "wan21" else 48, 2, 4, 6))
    with torch.inference_mode():
        expected = _decode(vae, z)
        attrs = dict(vars(vae))
        new = with_decoder_precision(vae, "bf16")
        got = _decode(new, z)
        assert vars(vae) == attrs and torch.equal(_decode(vae, z), expected)  # untouched
    model = new.first_stage_model
    assert model is not vae.first_stage_model
    assert isinstance(new.patcher, comfy.model_patcher.ModelPatcher) and new.patcher.model is model
    assert new.patcher is not vae.patcher
    for name, p in model.named_parameters():
        want = torch.bfloat16 if name.startswith(COMFY_DECODER_SIDE) else torch.float32
        assert p.dtype == want, name
    assert all(p.dtype == vae.vae_dtype for p in vae.first_stage_model.parameters())
    assert got.shape == expected.shape and torch.isfinite(got).all()
    # bf16 decoder: 8 mantissa bits, ~20 layers; images in [0, 1] (peak 1).
    assert psnr(got, expected, peak=1.0) >= 30.0


def test_fp32_precision_copy_decodes_exactly(vaes):
    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 2, 4, 6))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "fp32")
        if vae.vae_dtype == torch.float32:  # ComfyUI's choice on the CPU
            assert torch.equal(_decode(new, z), _decode(vae, z))


def test_precision_copy_encodes_with_the_fp32_encoder(vaes):
    vae, _, _ = vaes["wan21"]
    pixels = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "fp16")
        latent = comfy_nodes().VAEEncode().encode(new, pixels)[0]["samples"]
        if vae.vae_dtype == torch.float32:
            expected = comfy_nodes().VAEEncode().encode(vae, pixels)[0]["samples"]
            assert torch.equal(latent, expected)
    assert latent.dtype == torch.float32 and latent.shape[:3] == (1, 16, 2)


def test_precision_node_then_fast_decode(vaes):
    pack = loaded_pack()
    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 2, 4, 6))
    with torch.inference_mode():
        new = pack["WanVAEDecodePrecision"].execute(vae=vae, precision="fp16").args[0]
        lossless = _decode(new, z)
        install_fast_path(new.first_stage_model)
        with gates_opened(new, False):
            assert torch.equal(_decode(new, z), lossless)
        with gates_opened(new, True):
            high = _decode(new, z)
    assert torch.isfinite(high).all()
    assert psnr(high, lossless, peak=1.0) >= 30.0  # fp16 activations, rounded differently


def test_unloading_the_copy_leaves_the_original_loaded_state_alone(vaes):
    import comfy.model_management as mm

    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 1, 4, 6))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "bf16")
        _decode(new, z)
        expected = _decode(vae, z)
        mm.unload_all_models()
        assert torch.equal(_decode(vae, z), expected)
        _decode(new, z)  # the copy loads again on its own
