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
So the installed classes survive (nothing to re-install on ``ON_LOAD``); a fused module must
compute with what ``cast_bias_weight`` hands over for the call (never ``module.weight``), give
it back with ``uncast_bias_weight``, keep folds only of resident slots (and refold when ComfyUI
faults new tensors in), and leave a module whose weights are streamed per call to its stock
forward.
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui]

LATENT = (1, 4, 4, 4)  # 32x32 px: each interpreted high decode of the tiny VAE takes seconds
# fp32 on the CPU, fast vs stock: a few ULPs compounded over the decoder's layers measure
# ~2e-6 of the output range for this VAE; old (stale) weights would be off by O(1).
REL_TOL = 1e-4


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


class _VramSlots:
    """Every ``comfy.ops`` module of ``model`` in the state dynamic VRAM leaves it in.

    Its Parameters become NaN placeholders (``module.weight`` is not what a call computes with)
    and ``comfy.ops.cast_bias_weight`` - which ComfyUI's ops and the fused modules both call -
    faults the real weights into a "VRAM slot": while resident it hands back the same
    ``_v_weight``/``_v_bias`` tensors every call, as the real one does; ``evict()`` drops them so
    the next call faults new tensors in (from ``real``, which a test may change), and with
    ``streaming`` every call gets fresh copies (the slot cannot hold them). Each offloadable
    fetch must be given back with ``uncast_bias_weight`` (``open`` counts what is not).
    """

    def __init__(self, model, monkeypatch, norm_dtype=None):
        """``norm_dtype``: the GroupNorms' slots keep their weights in that dtype (the model's),
        tagged on the Parameter as ComfyUI's loader tags it (``_model_dtype``)."""
        import comfy.ops

        self.faults, self.real, self.open, self.streaming = {}, {}, 0, False
        self._by_id, self.kept = {}, {}
        for name, m in model.named_modules():
            if not hasattr(m, "comfy_cast_weights"):
                continue
            monkeypatch.setattr(m, "comfy_cast_weights", True, raising=False)
            for attr, value in (("seed_key", name), ("_v", ("slot", name)),
                                ("_v_signature", ("resident",)),
                                ("weight_function", []), ("bias_function", [])):
                monkeypatch.setattr(m, attr, value, raising=False)
            self.real[name] = {k: p.detach().clone() for k, p in m._parameters.items()
                               if p is not None}
            for k, p in self.real[name].items():
                m._parameters[k] = torch.nn.Parameter(torch.full_like(p, float("nan")),
                                                      requires_grad=False)
            if norm_dtype is not None and isinstance(m, torch.nn.GroupNorm):
                self.kept[name] = norm_dtype
                m._parameters["weight"]._model_dtype = norm_dtype
            self.faults[name] = 0
            self._by_id[id(m)] = (name, m)
        cast, uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

        def fake_cast(s, input=None, dtype=None, device=None, bias_dtype=None,
                      offloadable=False, **kwargs):
            hit = self._by_id.get(id(s))
            if hit is None:
                return cast(s, input, dtype, device, bias_dtype, offloadable=offloadable, **kwargs)
            name, m = hit
            real = self.real[name]
            slot_dtype = self.kept.get(name, input.dtype)
            if self.streaming or "_v_weight" not in m.__dict__:
                self.faults[name] += 1
                w = real["weight"].to(input.device, slot_dtype, copy=True)
                b = None if "bias" not in real else real["bias"].to(input.device, slot_dtype,
                                                                    copy=True)
                if self.streaming:
                    m.__dict__.pop("_v_weight", None)
                    m.__dict__.pop("_v_bias", None)
                    return (w, b, ("slot",)) if offloadable else (w, b)
                m.__dict__["_v_weight"], m.__dict__["_v_bias"] = w, b
            if offloadable:
                self.open += 1
            w, b = m.__dict__["_v_weight"], m.__dict__["_v_bias"]
            want = dtype or input.dtype
            if w.dtype != want:  # cast to what the caller computes in: a copy per call
                w, b = w.to(want), None if b is None else b.to(want)
            return (w, b, ("slot", s)) if offloadable else (w, b)

        def fake_uncast(s, weight, bias, state):
            if isinstance(state, tuple) and state[:1] == ("slot",):
                self.open -= 1 if len(state) == 2 else 0
                return None
            return uncast(s, weight, bias, state)

        monkeypatch.setattr(comfy.ops, "cast_bias_weight", fake_cast)
        monkeypatch.setattr(comfy.ops, "uncast_bias_weight", fake_uncast)

    def evict(self):
        for _, m in self._by_id.values():
            m.__dict__.pop("_v_weight", None)
            m.__dict__.pop("_v_bias", None)


def test_dynamic_vram_runs_fused_on_comfys_resident_weights(pack, vae, monkeypatch):
    model = vae.first_stage_model
    report = pack_module("fastpath.install")
    cache = pack_module("fastpath.cache")
    z = _latent()
    with torch.inference_mode():
        expected = _stock(vae, z)
        high, ui = _fast(pack, vae, z, "high")  # installs and loads the VAE
    assert ui["path"] == "high", ui["text"]
    swapped = _swapped(model)
    installed = report.install_report(model)
    assert swapped and installed.fused > 0

    slots = _VramSlots(model, monkeypatch)
    decoder_ops = [n for n in slots.faults if n.startswith("decoder.")]
    with torch.inference_mode():
        assert torch.equal(_stock(vae, z), expected)  # the simulation computes the same
        lossless, _ = _fast(pack, vae, z, "lossless")
        faults = dict(slots.faults)
        high, ui = _fast(pack, vae, z, "high")
    assert torch.equal(lossless, expected)
    # Fused on the resident slots ComfyUI's cast handed over (nothing re-faulted, nothing read
    # the NaN placeholders), every fetch given back, and no block left stock for it.
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert slots.faults == faults and slots.open == 0
    assert torch.isfinite(high).all() and _rel_err(high, expected) < REL_TOL
    assert cache.cache_bytes(model) > 0  # folds of resident weights are kept
    assert _swapped(model) == swapped  # classes untouched by the loader
    assert report.install_fast_path(model) is installed  # nothing re-installed

    # ComfyUI evicts the slots and faults other bytes in (a LoRA, a reloaded file): the folds
    # follow the new tensors.
    for name in decoder_ops:
        for k in slots.real[name]:
            slots.real[name][k] = slots.real[name][k] * 0.75
    slots.evict()
    with torch.inference_mode():
        changed = _stock(vae, z)
        high, ui = _fast(pack, vae, z, "high")
    assert _rel_err(changed, expected) > 1e-2
    assert ui["path"] == "high" and _rel_err(high, changed) < REL_TOL, ui["text"]


def _one_lookup_agrees(weights, module, x) -> None:
    """``call_tensors`` (a graph replay's fingerprint) gives what the three lookups give, for
    a module already fetched in the open scope."""
    reason, tensors, stable = weights.call_tensors(module, x)
    assert reason is None and stable == weights.is_stable(module)
    assert all(t is weights.weight_of(module, n)
               for t, n in zip(tensors, module._parameters, strict=True))


def test_norm_weights_kept_in_the_models_dtype_are_fetched_in_place(pack, vae, monkeypatch):
    """Dynamic VRAM keeps a GroupNorm's weights in the model's dtype (fp32 in a bf16 decode; fp64
    against fp32 here): the fused norm takes the slot's own tensors, the same every call (so a
    fold or a CUDA graph may keep them), not a cast copy per call; the decode stays close."""
    model = vae.first_stage_model
    z = _latent()
    with torch.inference_mode():
        expected = _stock(vae, z)
        _fast(pack, vae, z, "high")
    slots = _VramSlots(model, monkeypatch, norm_dtype=torch.float64)
    weights = pack_module("fastpath.comfyui.weights")
    norm = model.decoder.mid.block_1.norm1
    x = torch.zeros(1, norm.num_channels, 2, 2)
    fetched = []
    with torch.inference_mode():
        for _ in range(2):
            with weights.weights_for_call():
                assert weights.fetch_reason(norm, x) is None
                assert weights.is_stable(norm)
                fetched.append(weights.weight_of(norm))
                _one_lookup_agrees(weights, norm, x)
        high, ui = _fast(pack, vae, z, "high")
    assert fetched[0] is fetched[1] is norm.__dict__["_v_weight"]
    assert fetched[0].dtype == torch.float64 and slots.open == 0
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert _rel_err(high, expected) < REL_TOL


def _force_loaded(pack, vae, z, kept_in_fp64):
    """The model as dynamic VRAM leaves modules of at most 16 KiB: their Parameters force-loaded
    onto the device, ``comfy_cast_weights`` still set; ``kept_in_fp64(m)`` modules keep theirs
    in the model's dtype (fp32 in a bf16 decode; fp64 against fp32 here). Returns the stock
    decode of ``z`` from before."""
    with torch.inference_mode():
        expected = _stock(vae, z)
        _fast(pack, vae, z, "high")
    for m in vae.first_stage_model.modules():
        if hasattr(m, "comfy_cast_weights"):
            m.comfy_cast_weights, m.weight_function, m.bias_function = True, [], []
        if kept_in_fp64(m):
            for k in ("weight", "bias"):
                m._parameters[k] = torch.nn.Parameter(m._parameters[k].double(),
                                                      requires_grad=False)
    return expected


def test_small_norms_force_loaded_in_the_models_dtype_are_fetched_in_place(pack, vae, monkeypatch):
    """A module of at most 16 KiB gets no VRAM slot: dynamic VRAM force-loads its Parameters
    onto the device in the model's dtype (a 512-channel norm in fp32 in a bf16 decode; fp64
    against fp32 here) and still sets ``comfy_cast_weights``. Through ComfyUI's own cast the
    fused norm gets those Parameters themselves every call (a CUDA graph may keep them; cast to
    the input's dtype they were a copy per call, the H200 probe's 'mid.block_1.norm1: weights
    copied per call'), and the decode stays close. Once the cast has handed them back it is not
    asked again (a graph replay fetches every weight first, with the GPU idle); a weight patch
    (LoRA) attached later is ComfyUI's to apply again."""
    import comfy.ops

    model = vae.first_stage_model
    z = _latent()
    expected = _force_loaded(pack, vae, z, lambda m: isinstance(m, torch.nn.GroupNorm))
    weights = pack_module("fastpath.comfyui.weights")
    norm = model.decoder.mid.block_1.norm1
    x = torch.zeros(1, norm.num_channels, 2, 2)
    real, asked = comfy.ops.cast_bias_weight, []
    monkeypatch.setattr(comfy.ops, "cast_bias_weight",
                        lambda s, *a, **k: asked.append(s) or real(s, *a, **k))

    def fetch():
        with weights.weights_for_call():
            assert weights.fetch_reason(norm, x) is None
            _one_lookup_agrees(weights, norm, x)
            return weights.weight_of(norm), weights.bias_of(norm), weights.is_stable(norm)

    with torch.inference_mode():
        for _ in range(2):
            weight, bias, stable = fetch()
            assert weight is norm._parameters["weight"] and bias is norm._parameters["bias"]
            assert stable
        assert asked.count(norm) == 1
        norm.weight_function = [lambda w: w * 2]
        patched, _, stable = fetch()
        assert asked.count(norm) == 2 and not stable and torch.equal(patched, norm.weight * 2)
        norm.weight_function = []
        high, ui = _fast(pack, vae, z, "high")
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert _rel_err(high, expected) < REL_TOL


def test_small_convs_force_loaded_in_the_models_dtype_get_one_kept_cast(pack, vae):
    """The 3-channel conv_out is small enough to be force-loaded too (fp32 in a bf16 decode;
    fp64 against fp32 here). ComfyUI's cast of it is a new copy each call; its result is kept
    while the Parameters stay the same tensors (the same copy every call, so a CUDA graph may
    keep it), made again when ComfyUI replaces them, and dropped on unload."""
    model = vae.first_stage_model
    z = _latent()
    conv = model.decoder.conv_out
    expected = _force_loaded(pack, vae, z, lambda m: m is conv)
    weights = pack_module("fastpath.comfyui.weights")
    cache = pack_module("fastpath.cache")
    x = torch.zeros(1, conv.in_channels, 2, 2)

    def fetch():
        with weights.weights_for_call():
            assert weights.fetch_reason(conv, x) is None and weights.is_stable(conv)
            _one_lookup_agrees(weights, conv, x)
            return weights.weight_of(conv), weights.bias_of(conv)

    with torch.inference_mode():
        first, second = fetch(), fetch()
        high, ui = _fast(pack, vae, z, "high")
        assert first[0] is second[0] and first[1] is second[1]
        assert first[0].dtype == torch.float32
        assert torch.equal(first[0], conv.weight.float()) and torch.equal(first[1], conv.bias.float())
        conv._parameters["weight"] = torch.nn.Parameter(conv.weight * 2, requires_grad=False)
        replaced = fetch()
        assert replaced[0] is not first[0] and torch.equal(replaced[0], conv.weight.float())
    assert ui["path"] == "high" and "stock calls" not in ui["text"], ui["text"]
    assert _rel_err(high, expected) < REL_TOL
    cache.drop_fast_path_caches(model)
    assert "comfy_cast_copy" not in conv.__dict__.get("_fvd_cache", {})


def test_weights_streamed_per_call_keep_the_stock_path(pack, vae, monkeypatch):
    """A VRAM slot that cannot hold its module (the model does not fit): ComfyUI streams the
    weights per call and its own forward stays in charge of that module, exactly."""
    model = vae.first_stage_model
    z = _latent()
    with torch.inference_mode():
        expected = _stock(vae, z)
        _fast(pack, vae, z, "high")
    slots = _VramSlots(model, monkeypatch)
    slots.streaming = True
    with torch.inference_mode():
        high, ui = _fast(pack, vae, z, "high")
    streamed = pack_module("fastpath.comfyui.weights").STREAMED
    assert streamed in ui["text"] and slots.open == 0, ui["text"]
    assert torch.equal(high, expected)
    assert pack_module("fastpath.cache").cache_bytes(model) == 0


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


def _as_dynamic(vae, monkeypatch):
    """Marks ``vae``'s patcher as a dynamic-VRAM one the way the skip check reads it; CPU load
    devices never get a real ``ModelPatcherDynamic``. Everything else is the tree's own state."""
    patcher = vae.patcher
    monkeypatch.setattr(patcher, "is_dynamic", lambda: True, raising=False)
    pins = {patcher.load_device: {"active": True, "failed": False}}
    monkeypatch.setattr(patcher.model, "dynamic_pins", pins, raising=False)
    return patcher


def test_a_resident_dynamic_vae_is_not_reloaded_until_something_changes(pack, monkeypatch):
    """``fastpath.comfyui.loading`` against this tree's real ``load_models_gpu`` state: the
    attributes it reads exist, an unchanged VAE skips the reload, and another model's load or
    new weight patches bring ComfyUI's load back."""
    import comfy.model_management as mm

    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    loading = pack_module("fastpath.comfyui.loading")
    first, other = comfy_vae("sdxl", seed=0, tiny=True), comfy_vae("sdxl", seed=1, tiny=True)
    patcher = _as_dynamic(first, monkeypatch)
    _as_dynamic(other, monkeypatch)
    calls = []
    real = mm.load_models_gpu
    monkeypatch.setattr(mm, "load_models_gpu", lambda *a, **k: (calls.append(a[0][0]),
                                                                 real(*a, **k)))
    memory = 1 << 20

    assert loading.load_for_decode(first, memory) is None
    assert loading.resident_reason(mm, patcher, memory) is None
    assert loading.load_for_decode(first, memory) is not None
    assert calls == [patcher]

    loading.load_for_decode(other, memory)
    assert loading.resident_reason(mm, patcher, memory) == "another model was loaded since"
    assert loading.load_for_decode(first, memory) is None

    key = "decoder.conv_out.weight"
    patcher.add_patches({key: (torch.zeros_like(patcher.model.state_dict()[key]),)}, 1.0)
    assert loading.resident_reason(mm, patcher, memory) is not None
    assert loading.load_for_decode(first, memory) is None
    assert calls == [patcher, other.patcher, patcher, patcher]
    mm.unload_all_models()

