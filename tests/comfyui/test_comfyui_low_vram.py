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
(Tier 3, weights on the CPU while the latent is on the GPU, is in test_comfyui_low_vram_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui
from support.comfy_low_vram import _fast_node, _latent, _mark_offloaded, _ops_leaves, _stock_node

pytestmark = [requires_comfyui, pytest.mark.comfyui]


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


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / (b.float().max() - b.float().min())).item()


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
