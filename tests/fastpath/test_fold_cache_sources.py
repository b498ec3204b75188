"""Folded buffers follow the weights they were folded from (tier 1, CPU, tiny diffusers VAE).

ComfyUI builds and runs models under ``torch.inference_mode()``: its executor wraps every
prompt in it, so a VAE loaded by a loader node has inference-tensor Parameters, which have no
version counter. The fold cache must still notice when the weights change between two fast
decodes of a model that stays installed and loaded:
- new Parameter objects (``comfy.utils.set_attr_param``: LoRA patch/unpatch, dynamic VRAM's
  force-loaded weights and restored backups, ``load_state_dict(assign=True)``);
- values copied into the same Parameters by ``load_state_dict`` (a node loading other weights
  into a VAE it was given); in inference mode this leaves no trace on the tensor itself.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath import cache, quality

pytest.importorskip("diffusers")

LATENT = (1, 4, 8, 8)  # 16x16 output through the tiny VAE's two levels: quick in the interpreter
# fp32 on the CPU, open gate vs stock: a few ULPs compounded over ~10 layers measure ~2e-6 of
# the output range (test_kl_family.py); a stale fold (the old weights) is off by O(1).
REL_TOL = 1e-4


def _vae(seed):
    from fast_vae_decode.bench.models import diffusers_vae

    return diffusers_vae("sdxl", seed=seed, tiny=True)


def _decode(vae, quality_name, z):
    return quality.decode_at_quality(vae, quality_name, lambda: vae.decode(z).sample)[0]


def _rel_err(a, b):
    return ((a - b).abs().max() / (b.max() - b.min())).item()


def _folds(model):
    return {(path, name) for path, m in model.named_modules()
            for name in m.__dict__.get("_fvd_cache", {})}


@pytest.fixture()
def loaded():
    """A tiny VAE built, installed and decoded fast under inference mode, as in ComfyUI."""
    z = torch.randn(LATENT, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        vae = _vae(seed=0)
        assert vae.decoder.conv_in.weight.is_inference()
        first = _decode(vae, "high", z)
    assert _folds(vae), "the fast decode should have folded the attention and upsample weights"
    return vae, z, first


def test_values_loaded_into_the_same_parameters_rebuild_the_folds(loaded):
    vae, z, first = loaded
    other = _vae(seed=5).state_dict()
    with torch.inference_mode():
        ptrs = {k: p.data_ptr() for k, p in vae.named_parameters()}
        vae.load_state_dict(other)
        assert {k: p.data_ptr() for k, p in vae.named_parameters()} == ptrs  # copied in place
        expected = _decode(vae, "lossless", z)
        out = _decode(vae, "high", z)
    assert _rel_err(first, expected) > 0.1  # the new weights really decode differently
    assert _rel_err(out, expected) < REL_TOL


def test_new_parameter_objects_rebuild_the_folds(loaded):
    vae, z, first = loaded
    other = _vae(seed=6).state_dict()
    with torch.inference_mode():
        for key, value in other.items():  # what comfy.utils.set_attr_param does, key by key
            owner, _, name = key.rpartition(".")
            setattr(vae.get_submodule(owner), name, torch.nn.Parameter(value.clone(),
                                                                       requires_grad=False))
        expected = _decode(vae, "lossless", z)
        out = _decode(vae, "high", z)
    assert _rel_err(first, expected) > 0.1
    assert _rel_err(out, expected) < REL_TOL


def test_unchanged_weights_keep_their_folds(loaded):
    vae, z, first = loaded
    before = {(path, name): entry for path, m in vae.named_modules()
              for name, entry in m.__dict__.get("_fvd_cache", {}).items()}
    with torch.inference_mode():
        out = _decode(vae, "high", z)
    after = {(path, name): entry for path, m in vae.named_modules()
             for name, entry in m.__dict__.get("_fvd_cache", {}).items()}
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)  # nothing refolded
    assert torch.equal(out, first)
    assert cache.cache_bytes(vae) > 0


def test_a_fold_of_an_ordinary_tensor_follows_its_in_place_writes():
    """Outside inference mode a tensor's version counter tells an in-place write; an inference
    tensor (no counter) is keyed without one, and both hit the cache while unchanged."""
    from fast_vae_decode.fastpath.cache import cached

    module = torch.nn.Module()
    weight = torch.ones(3)
    builds = []

    def build():
        builds.append(weight.clone())
        return weight * 2

    assert torch.equal(cached(module, "w", (weight,), build), torch.full((3,), 2.0))
    cached(module, "w", (weight,), build)
    assert len(builds) == 1
    with torch.no_grad():
        weight.add_(1)  # same object and address, new version
    assert torch.equal(cached(module, "w", (weight,), build), torch.full((3,), 4.0))
    assert len(builds) == 2
    with torch.inference_mode():
        frozen = torch.ones(3)
    other = torch.nn.Module()
    cached(other, "w", (frozen,), lambda: frozen * 2)
    assert torch.equal(cached(other, "w", (frozen,), lambda: frozen * 3), torch.full((3,), 2.0))
