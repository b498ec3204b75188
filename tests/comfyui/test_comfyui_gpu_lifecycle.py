"""Unloading and reloading a VAE through ComfyUI's model management.

The fast path's folded buffers are caches: built on the first fast decode, kept while the VAE
stays loaded, dropped when ComfyUI unloads the model (our ``ON_DETACH`` hook), rebuilt on the
next fast decode. ComfyUI "detaches" a loaded model without unloading it at the start of every
``load_models_gpu`` for it (``detach(unpatch_all=False)``, i.e. on every decode): that must not
drop the caches, or every decode would pay the folding again.

Tier 2 (CPU, ``COMFYUI_PATH``, fast path under ``TRITON_INTERPRET=1``): cache lifetime on a
tiny VAE. Tier 3 (``cuda`` and ``COMFYUI_PATH``): 20 unload/reload cycles of a full-size SDXL
VAE; GPU memory must not grow (``pytest -s`` prints the numbers per cycle).
"""
from __future__ import annotations

import gc

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui]

CYCLES = 20
# Allocator rounding and ComfyUI's own small per-load state (cast buffers, streams) may move a
# few MiB between cycles; a leaked fold of the SDXL decoder's upsample convs alone is ~20 MiB
# in bf16, and a leaked decoder ~100 MiB, so 8 MiB separates noise from a leak.
GROWTH_TOLERANCE = 8 * 2**20


def _fold_tensors(model) -> dict:
    """Every cached fast-path value under ``model``, by (module path, cache name)."""
    found = {}
    for path, m in model.named_modules():
        for name, entry in m.__dict__.get("_fvd_cache", {}).items():
            found[(path, name)] = entry[1]  # (key, value, ...): the folded value
    return found


def _high(pack, vae, z):
    out = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality="high")
    return out.args[0], out.ui["fast_vae_decode"][0]


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


@pytest.mark.cuda
def test_twenty_unload_reload_cycles_do_not_grow_gpu_memory(pack):
    import comfy.model_management as mm

    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    cache = pack_module("fastpath.cache")
    mm.unload_all_models()
    mm.soft_empty_cache()
    vae = comfy_vae("sdxl", seed=0)  # full size, ComfyUI's own device and dtype
    model = vae.first_stage_model
    z = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(1))
    allocated, reference = [], None
    try:
        for cycle in range(CYCLES):
            with torch.inference_mode():
                images, ui = _high(pack, vae, z)
            assert ui["path"] == "high", ui["text"]
            built = cache.cache_bytes(model)
            assert built > 0  # built (cycle 0) or rebuilt (later cycles) on demand
            if reference is None:
                reference = images
            else:
                # Rebuilt folds compute the same; GPU library calls are not promised to be
                # bitwise repeatable run to run, so allow a quarter of an 8-bit step.
                assert (images - reference).abs().max().item() <= 1e-3
            del images
            mm.unload_all_models()
            mm.soft_empty_cache()
            gc.collect()
            assert cache.cache_bytes(model) == 0  # the unload dropped them
            assert not any(p.is_cuda for p in model.parameters())
            allocated.append(torch.cuda.memory_allocated())
            print(f"cycle {cycle:2d}: caches built {built / 2**20:7.1f} MiB, "
                  f"allocated after unload {allocated[-1] / 2**20:8.1f} MiB")
    finally:
        mm.unload_all_models()
        mm.soft_empty_cache()
    growth = max(allocated[1:]) - allocated[0]
    print(f"growth after the first cycle: {growth / 2**20:.1f} MiB")
    assert growth <= GROWTH_TOLERANCE, [a / 2**20 for a in allocated]
