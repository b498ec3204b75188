"""Newer ComfyUI's dynamic VRAM, simulated on a tiny VAE in the trees we can run (tier 2, CPU).

What ``comfy.model_patcher.ModelPatcherDynamic`` (2026; ``is_dynamic()`` is True, used when
``comfy_aimdo`` initialises, never for a CPU load device) does to a loaded model, from its
``load``/``partially_unload`` and ``comfy.ops.cast_bias_weight``:
- it never replaces modules or their classes; it sets attributes on each ``comfy.ops`` module
  instance: ``comfy_cast_weights = True``, ``seed_key``, ``pin_failed``, ``_v_signature``,
  ``weight_function``/``bias_function`` lists, ``weight_lowvram_function``/
  ``bias_lowvram_function`` (LoRA), and ``_v`` (its slice of a virtual VRAM area);
- the weights a forward uses are faulted into that area per call (``cast_bias_weight`` via
  ``_v``); ``module.weight`` itself stays on the offload device;
- Parameters of other modules, and weights it force-loads, are replaced by new Parameter
  objects (``comfy.utils.set_attr_param``), and restored from backups on unload.
So the installed classes survive (nothing to re-install on ``ON_LOAD``), every fused module
must take the stock path (its weights are not what the call computes with), and a module fed
new Parameter objects must read them live, refolding what it folded.
"""
from __future__ import annotations

import pytest
import torch

from comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui]

LATENT = (1, 4, 4, 4)  # 32x32 px: each interpreted high decode of the tiny VAE takes seconds
# fp32 on the CPU, fast vs stock: a few ULPs compounded over the decoder's layers measure
# ~2e-6 of the output range for this VAE; old (stale) weights would be off by O(1).
REL_TOL = 1e-4
CAST = "weights streamed per call (ComfyUI dynamic VRAM)"


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    # Run the fast path on CPU tensors, so a fused module that wrongly took its fast path
    # here would compute with the placeholder weights and show it.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture()
def vae():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return comfy_vae("sdxl", seed=0, tiny=True)


def _latent():
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(1))


def _stock(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def _fast(pack, vae, z, quality):
    out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)
    return out.args[0], out.ui["fast_vae_decode"][0]


def _rel_err(a, b):
    return ((a - b).abs().max() / (b.max() - b.min())).item()


def _swapped(model):
    swap = pack_module("fastpath.swap")
    return {name: type(m) for name, m in model.named_modules() if swap.is_swapped(m)}


def _dynamic_load(model, monkeypatch) -> dict:
    """Put every ``comfy.ops`` module of ``model`` in the state dynamic VRAM leaves it in.

    Its Parameter becomes a NaN placeholder (``module.weight`` is not what a call computes
    with), and ComfyUI's per-call cast path faults the real weights in as new Parameter
    objects for that call only. Returns per-module fault counts.
    """
    faults = {}
    for name, m in model.named_modules():
        if not hasattr(m, "comfy_cast_weights"):
            continue
        monkeypatch.setattr(m, "comfy_cast_weights", True, raising=False)
        for attr, value in (("seed_key", name), ("pin_failed", False), ("_v_signature", None),
                            ("weight_function", []), ("bias_function", []),
                            ("weight_lowvram_function", None), ("bias_lowvram_function", None)):
            monkeypatch.setattr(m, attr, value, raising=False)
        real = {k: p.detach().clone() for k, p in m._parameters.items() if p is not None}
        for k, p in real.items():
            m._parameters[k] = torch.nn.Parameter(torch.full_like(p, float("nan")),
                                                  requires_grad=False)
        stock = m.forward_comfy_cast_weights
        faults[name] = 0

        def faulted(*args, _m=m, _real=real, _stock=stock, _name=name, **kwargs):
            placeholders = dict(_m._parameters)
            for k, v in _real.items():
                _m._parameters[k] = torch.nn.Parameter(v.clone(), requires_grad=False)
            faults[_name] += 1
            try:
                return _stock(*args, **kwargs)
            finally:
                _m._parameters.update(placeholders)

        monkeypatch.setattr(m, "forward_comfy_cast_weights", faulted, raising=False)
    return faults


def test_dynamic_vram_state_keeps_the_classes_and_decodes_exactly(pack, vae, monkeypatch):
    model = vae.first_stage_model
    report = pack_module("fastpath.install")
    z = _latent()
    with torch.inference_mode():
        expected = _stock(vae, z)
        high, ui = _fast(pack, vae, z, "high")  # installs, folds, and loads the VAE
    assert ui["path"] == "high", ui["text"]
    assert _rel_err(high, expected) < REL_TOL
    swapped = _swapped(model)
    installed = report.install_report(model)
    assert swapped and installed.fused > 0

    faults = _dynamic_load(model, monkeypatch)
    decoder_ops = [n for n in faults if n.startswith("decoder.")]
    with torch.inference_mode():
        assert torch.equal(_stock(vae, z), expected)  # the simulation computes the same
        lossless, _ = _fast(pack, vae, z, "lossless")
        before = dict(faults)
        high, ui = _fast(pack, vae, z, "high")
    assert torch.equal(lossless, expected)
    # Every decoder op faulted its weights in for the high decode: nothing read the
    # placeholders directly, so the decode is the stock one, bit for bit.
    assert all(faults[n] == before[n] + 1 for n in decoder_ops)
    assert torch.equal(high, expected)
    assert ui["path"] == "fallback" and ui["reason"] == CAST, ui["text"]
    assert _swapped(model) == swapped  # classes untouched by the loader
    assert report.install_fast_path(model) is installed  # nothing re-installed


def test_parameters_replaced_by_comfys_set_attr_param_are_read_live(pack, vae):
    """Force-loaded weights and restored backups arrive as new Parameter objects between
    decodes of a model that stays installed and loaded: fused modules read them live and
    refold what they folded."""
    import comfy.utils

    from fast_vae_decode.bench.models import comfy_state_dict

    model = vae.first_stage_model
    cache = pack_module("fastpath.cache")
    z = _latent()
    with torch.inference_mode():
        old, ui = _fast(pack, vae, z, "high")
        assert ui["path"] == "high" and cache.cache_bytes(model) > 0
        new_weights = comfy_state_dict("sdxl", seed=3, tiny=True)
        for key, value in new_weights.items():
            if key.startswith("decoder.") or key.startswith("post_quant_conv."):
                comfy.utils.set_attr_param(model, key, value)
        expected = _stock(vae, z)
        high, ui = _fast(pack, vae, z, "high")
    assert ui["path"] == "high", ui["text"]
    assert _rel_err(old, expected) > 0.1  # the new weights decode differently
    assert _rel_err(high, expected) < REL_TOL


# Per-module state newer ComfyUI's dynamic loader and its pinned-memory staging put on each
# comfy.ops module (ModelPatcherDynamic.load, comfy.ops.cast_bias_weight_with_vbar,
# comfy.pinned_memory.pin_memory): handles into that model's VRAM area and host buffers.
DYNAMIC_STATE = {
    "_v": ("vbar slot of the original",), "_v_signature": ("resident",), "seed_key": None,
    "pin_failed": False, "weight_lowvram_function": None, "bias_lowvram_function": None,
    "_pin_state": {}, "_pin_registered": True, "_pin_stack_index": 0,
    "_pin_balancer_priority": 0,
}


def test_precision_copy_starts_without_the_dynamic_loaders_state(pack):
    """WanVAEDecodePrecision copies a VAE the dynamic loader has prepared: the copy must not
    inherit the original's VRAM slots or pinned buffers (its casts would read the original's
    bytes) nor its forced per-call casting; its own patcher prepares it when it loads."""
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    vae = comfy_vae("wan21", seed=0, tiny=True)
    ops = []
    for name, m in vae.first_stage_model.named_modules():
        if not hasattr(m, "comfy_cast_weights"):
            continue
        ops.append(name)
        m.comfy_cast_weights = True  # set without prev_comfy_cast_weights by the dynamic loader
        for attr, value in DYNAMIC_STATE.items():
            m.__dict__[attr] = value
        m.__dict__["seed_key"] = name
        m.__dict__["_v_weight"] = m.weight.detach()  # the original's resident copy
        m.__dict__["_pin"] = torch.empty(8, dtype=torch.uint8)  # its pinned staging buffer
    assert ops
    copy = pack["WanVAEDecodePrecision"].execute(vae=vae, precision="bf16").args[0]
    copied = dict(copy.first_stage_model.named_modules())
    for name in ops:
        leftovers = sorted(k for k in vars(copied[name])
                           if k in DYNAMIC_STATE or k.startswith(("_v_", "_pin")))
        assert not leftovers, f"{name} kept {leftovers}"
        assert not copied[name].comfy_cast_weights, name  # back to the class default
    # The original keeps its state: it is still the dynamic loader's to manage.
    original = dict(vae.first_stage_model.named_modules())
    assert all(original[n].comfy_cast_weights and "_v" in vars(original[n]) for n in ops)
