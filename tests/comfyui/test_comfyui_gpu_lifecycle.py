"""Unloading and reloading a VAE through ComfyUI's model management.

The fast path's folded buffers are caches: built on the first fast decode, kept while the VAE
stays loaded, dropped when ComfyUI unloads the model (our ``ON_DETACH`` hook), rebuilt on the
next fast decode. ComfyUI "detaches" a loaded model without unloading it at the start of every
``load_models_gpu`` for it (``detach(unpatch_all=False)``, i.e. on every decode): that must not
drop the caches, or every decode would pay the folding again.

Tier 2 (CPU, ``COMFYUI_PATH``, fast path under ``TRITON_INTERPRET=1``): cache lifetime on a
tiny VAE. (Tier 3, 20 unload/reload cycles of a full-size SDXL VAE on a GPU, is in
test_comfyui_gpu_lifecycle_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui
from support.comfy_lifecycle import _high

pytestmark = [requires_comfyui, pytest.mark.comfyui]


def _fold_tensors(model) -> dict:
    """Every cached fast-path value under ``model``, by (module path, cache name)."""
    found = {}
    for path, m in model.named_modules():
        for name, entry in m.__dict__.get("_fvd_cache", {}).items():
            found[(path, name)] = entry[1]  # (key, value, ...): the folded value
    return found


def test_caches_live_while_loaded_drop_on_unload_and_come_back(pack, monkeypatch):
    import comfy.model_management as mm

    from fast_vae_decode.bench.models import comfy_vae

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fast path (and its folds) on CPU tensors
    comfy_nodes()
    cache = pack_module("fastpath.cache")
    vae = comfy_vae("sdxl", seed=0, tiny=True)
    model = vae.first_stage_model
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        first, ui = _high(pack, vae, z)
        assert ui["path"] == "high", ui["text"]
        folds = _fold_tensors(model)
        assert folds and cache.cache_bytes(model) > 0
        second, ui = _high(pack, vae, z)
    # The second decode went through load_models_gpu (which detaches the loaded model without
    # unpatching it) and reused every fold: the same tensor objects, the same result.
    again = _fold_tensors(model)
    assert again.keys() == folds.keys()
    assert all(again[k] is folds[k] for k in folds), "folds were rebuilt while the VAE stayed loaded"
    assert torch.equal(first, second)

    mm.unload_all_models()
    assert cache.cache_bytes(model) == 0 and not _fold_tensors(model)
    with torch.inference_mode():
        third, ui = _high(pack, vae, z)
    assert ui["path"] == "high" and cache.cache_bytes(model) > 0  # rebuilt on demand
    assert torch.equal(third, first)
