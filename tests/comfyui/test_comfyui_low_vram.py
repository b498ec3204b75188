"""ComfyUI's low-VRAM modes: the fast path steps aside per module where ComfyUI streams weights.

When a model does not fit, ComfyUI's ``ModelPatcher`` (``load`` on a partial budget,
``partially_unload`` when another model needs the room, every module under ``--novram``)
leaves a module's weights on the offload device and sets, on that module instance,
``prev_comfy_cast_weights`` (the old value), ``comfy_cast_weights = True`` and empty
``weight_function``/``bias_function`` lists (LoRA patches go there as ``LowVramPatch``es);
``comfy_patched_weights`` is False for it. Its ``comfy.ops`` forward then casts or copies the
weights to the input's device on every call. Such a module must take that stock path; the rest
of the decoder stays fast.

Tier 2 (CPU, ``COMFYUI_PATH``): the fast path really runs, under ``TRITON_INTERPRET=1``.
Tier 3 (``cuda`` and ``COMFYUI_PATH``): weights on the CPU while the latent is on the GPU.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui]

LATENT = (1, 4, 4, 4)  # 32x32 px: each interpreted high decode of the tiny VAE takes seconds

# fp32 on the CPU, fast vs stock: reordered sums of a few ULPs compounded over the decoder's
# layers, measured ~2e-6 of the output range for this VAE; 1e-4 still catches a wrong layer.
REL_TOL = 1e-4


@pytest.fixture()
def interpreter(monkeypatch):
    # The fast path runs on CPU tensors only under the interpreter; without it every module
    # would be stock here and the per-module fallback would be invisible.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tiny_vae():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return comfy_vae("sdxl", seed=0, tiny=True)


def _latent(shape=LATENT, seed=1, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / (b.float().max() - b.float().min())).item()


def _stock_node(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def _fast_node(pack, vae, z, quality):
    out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)
    return out.args[0], out.ui["fast_vae_decode"][0]


def _mark_offloaded(module: torch.nn.Module) -> None:
    """What ComfyUI's ``ModelPatcher.load`` sets on a module it leaves offloaded."""
    module.prev_comfy_cast_weights = module.comfy_cast_weights
    module.comfy_cast_weights = True
    module.weight_function = []
    module.bias_function = []


def _ops_leaves(root: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in root.modules() if hasattr(m, "comfy_cast_weights")]


def _count_cast_calls(monkeypatch, modules) -> dict:
    """Count each module's trips through ComfyUI's per-call weight cast (``cast_bias_weight``,
    which the stock ops and the fused modules both call) and check every offloadable cast is
    given back (``uncast_bias_weight``) before the decode ends."""
    import comfy.ops

    counts = {id(m): 0 for m in modules}
    counts["open"] = 0
    cast, uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

    def counted_cast(s, *args, **kwargs):
        if id(s) in counts:
            counts[id(s)] += 1
            counts["open"] += 1 if kwargs.get("offloadable") else 0
        return cast(s, *args, **kwargs)

    def counted_uncast(s, *args, **kwargs):
        if id(s) in counts:
            counts["open"] -= 1
        return uncast(s, *args, **kwargs)

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", counted_cast)
    monkeypatch.setattr(comfy.ops, "uncast_bias_weight", counted_uncast)
    return counts


def test_offloaded_modules_take_comfys_cast_path_and_the_rest_stays_fast(
        pack, interpreter, monkeypatch):
    vae = _tiny_vae()
    decoder = vae.first_stage_model.decoder
    z = _latent()
    with torch.inference_mode():
        _stock_node(vae, z)  # ComfyUI loads the model (fully: --cpu has room for it)
    # Offload one whole level (res blocks and upsample) and one attention projection, as a
    # partial load does when the budget ends there; the model stays "loaded", so later
    # decodes through load_models_gpu keep this state (partially_load returns early).
    offloaded = _ops_leaves(decoder.up[2]) + [decoder.mid.attn_1.q]
    for m in offloaded:
        _mark_offloaded(m)
    counts = _count_cast_calls(monkeypatch, offloaded)
    with torch.inference_mode():
        expected = _stock_node(vae, z)
        lossless, ui = _fast_node(pack, vae, z, "lossless")
        assert torch.equal(lossless, expected) and ui["path"] == "lossless"
        assert all(counts[id(m)] == 2 for m in offloaded)  # VAEDecode and lossless both cast
        high, ui = _fast_node(pack, vae, z, "high")
    # high fetched each offloaded module's weights through ComfyUI's cast, gave them back, and
    # ran every block fused on them: casting is no reason to leave a block stock.
    assert all(counts[id(m)] == 3 for m in offloaded) and counts["open"] == 0
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert torch.isfinite(high).all() and _rel_err(high, expected) < REL_TOL
    with torch.inference_mode():
        assert torch.equal(_stock_node(vae, z), expected)  # the stock node is untouched


def test_per_call_weight_patches_take_comfys_cast_path(pack, interpreter):
    """A fully loaded module can still compute with other weights than its own: ComfyUI's
    ``load`` appends weight wrappers (and, offloaded, ``LowVramPatch``es) to
    ``weight_function``/``bias_function``, applied per call by the ops' cast path."""
    vae = _tiny_vae()
    decoder = vae.first_stage_model.decoder
    z = _latent()
    with torch.inference_mode():
        unpatched = _stock_node(vae, z)
    conv = decoder.up[1].block[0].conv2
    conv.weight_function = [lambda w: w * 0.5]
    conv.bias_function = [lambda b: b + 0.1]
    with torch.inference_mode():
        expected = _stock_node(vae, z)
        lossless, _ = _fast_node(pack, vae, z, "lossless")
        high, ui = _fast_node(pack, vae, z, "high")
    assert _rel_err(expected, unpatched) > 1e-2  # the patch changes the image
    assert torch.equal(lossless, expected)
    # Fused on the patched weights ComfyUI's cast hands over, not the raw ones.
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert _rel_err(high, expected) < REL_TOL


def test_comfys_own_partial_unload_falls_back_per_module(pack, interpreter):
    """ComfyUI's ``ModelPatcher.partially_unload`` (what frees room for another model) marks
    the modules it offloads itself; decode the decoder in that state, as a sampler's VAE
    decode between two loads would."""
    vae = _tiny_vae()
    model = vae.first_stage_model
    quality = pack_module("fastpath.quality")
    z = _latent().to(vae.vae_dtype)
    with torch.inference_mode():
        _stock_node(vae, z)
        before = model.decode(z)
    patcher = vae.patcher
    # A quarter of the model: ComfyUI offloads the smallest modules first, so this takes the
    # norms and some convs of the decoder, not all of it.
    patcher.partially_unload(patcher.offload_device, memory_to_free=patcher.model_size() // 4)
    try:
        cast = [n for n, m in model.decoder.named_modules()
                if getattr(m, "comfy_cast_weights", False)]
        kept = [n for n, m in model.decoder.named_modules()
                if hasattr(m, "comfy_cast_weights") and not m.comfy_cast_weights]
        assert cast and kept, "partially_unload should offload part of the decoder"
        with torch.inference_mode():
            lossless, outcome = quality.decode_at_quality(vae, "lossless", lambda: model.decode(z))
            assert torch.equal(lossless, before)  # ComfyUI's cast path computes the same
            high, outcome = quality.decode_at_quality(vae, "high", lambda: model.decode(z))
        # Every block ran fused, the offloaded ones on the weights ComfyUI's cast moved in.
        assert outcome.path == "high" and not outcome.fallbacks, outcome.text()
        assert torch.isfinite(high).all() and _rel_err(high, before) < REL_TOL
    finally:
        import comfy.model_management as mm

        mm.unload_all_models()  # leave no half-loaded model for the next test


# --- tier 3: weights on the CPU, latent on the GPU -----------------------------------------


def _psnr(a, b) -> float:
    a, b = a.float(), b.float()
    mse = torch.mean((a - b) ** 2).item()
    peak = (b.max() - b.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def _fp32_decode(vae, z):
    """The same decode by a private fp32 copy of the model, processed as VAE.decode does."""
    model = copy.deepcopy(vae.first_stage_model).to(device=vae.device, dtype=torch.float32)
    images = model.decode(z.to(device=vae.device, dtype=torch.float32)).float()
    return vae.process_output(images).to(vae.output_device).movedim(1, -1)


def _high(vae, z):
    """High through the loaded pack's decode_at_quality: the node's path, with its stats."""
    quality = pack_module("fastpath.quality")
    images, outcome = quality.decode_at_quality(vae, "high", lambda: vae.decode(z))
    return images, outcome


@pytest.fixture()
def gpu_vae():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    import comfy.model_management as mm

    mm.unload_all_models()
    vae = comfy_vae("sdxl", seed=0)  # full size, ComfyUI's own device and dtype choice
    yield vae
    mm.unload_all_models()
    mm.soft_empty_cache()


@pytest.mark.cuda
def test_gpu_decoder_with_some_weights_on_the_cpu(pack, gpu_vae):
    """What ``--novram``/``--lowvram`` leave behind for part of a model: weights on the CPU,
    cast to the GPU per call. High must not crash and must stay visually lossless."""
    vae = gpu_vae
    decoder = vae.first_stage_model.decoder
    z = _latent((1, 4, 64, 64), seed=2)
    with torch.inference_mode():
        _stock_node(vae, z)  # loads the VAE onto the GPU
        assert decoder.conv_in.weight.is_cuda
        # One full-resolution level and the mid attention go back to the CPU.
        for m in _ops_leaves(decoder.up[0]) + _ops_leaves(decoder.mid.attn_1):
            m.to("cpu")
            _mark_offloaded(m)
        assert not decoder.up[0].block[0].conv1.weight.is_cuda
        expected = _stock_node(vae, z)
        lossless, _ = _fast_node(pack, vae, z, "lossless")
        high, outcome = _high(vae, z)
        truth = _fp32_decode(vae, z)
    assert torch.equal(lossless, expected)
    # The offloaded modules run fused too, on the weights ComfyUI casts to the GPU per call.
    assert outcome.path == "high" and not outcome.fallbacks, outcome.text()
    assert torch.isfinite(high).all()
    # On these random weights bf16 rounding alone puts the stock decode ~48 dB from an fp32
    # decode (H200, measured), and any other bf16 evaluation order lands ~47 dB from stock, so
    # "visually lossless" is judged against fp32: high at least as close to it as stock, 1 dB
    # margin (high measured 49.0 dB vs stock 48.0 dB at SDXL 1024²).
    assert _psnr(high, truth) >= _psnr(expected, truth) - 1.0


@pytest.mark.cuda
def test_gpu_novram_mode(pack, gpu_vae, monkeypatch):
    """``--novram``: load_models_gpu gives the VAE a 0.1-byte budget, so ComfyUI itself leaves
    every ops module offloaded and casts it per call."""
    import comfy.model_management as mm

    cache = pack_module("fastpath.cache")
    vae = gpu_vae
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NO_VRAM)
    z = _latent((1, 4, 64, 64), seed=3)
    with torch.inference_mode():
        expected = _stock_node(vae, z)
        assert vae.first_stage_model.decoder.conv_in.comfy_cast_weights
        lossless, _ = _fast_node(pack, vae, z, "lossless")
        high, outcome = _high(vae, z)
    assert torch.equal(lossless, expected)
    # Every module fused on its per-call cast weights (folds built per call, never kept).
    assert outcome.path == "high" and not outcome.fallbacks, outcome.text()
    assert cache.cache_bytes(vae.first_stage_model) == 0
    assert torch.isfinite(high).all() and _psnr(high, expected) >= 45.0
