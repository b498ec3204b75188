"""Whose free memory ComfyUI's ``VAE.decode`` sizes its batch split by, read off its code
(``fastpath.comfyui.decode_batches``); tier 1, on stand-in methods shaped like each tree's.
Tier 2 (tests/comfyui/test_pixel_decode_comfyui.py) checks the split against real trees."""
from __future__ import annotations

import sys
import types

from fast_vae_decode.fastpath.comfyui import decode_batches

# The stand-ins reference names they never define: only their code is read, never run.
# ruff: noqa: F821


def decode_08(self, samples_in):  # through 0.8
    memory_used = self.memory_used_decode(samples_in.shape, self.vae_dtype)
    model_management.load_models_gpu([self.patcher], memory_required=memory_used)
    free_memory = model_management.get_free_memory(self.device)
    return max(1, int(free_memory / memory_used))


def decode_033(self, samples_in):  # 0.33 and newer
    memory_used = self.memory_used_decode(samples_in.shape, self.vae_dtype)
    model_management.load_models_gpu([self.patcher], memory_required=memory_used)
    free_memory = self.patcher.get_free_memory(self.device)
    return max(1, int(free_memory / memory_used))


def decode_elsewhere(self, samples_in):  # a query this pack has not seen
    return max(1, int(self.free_vram() / self.memory_used_decode(samples_in.shape, None)))


def decode_both(self, samples_in):  # two owners: which one splits is not known
    return min(self.patcher.get_free_memory(self.device), model_management.get_free_memory(self.device))


def test_the_owner_of_the_free_memory_query_is_read_off_the_code():
    assert decode_batches.batch_memory_source(decode_08) == decode_batches.MODEL_MANAGEMENT
    assert decode_batches.batch_memory_source(decode_033) == decode_batches.PATCHER
    assert decode_batches.batch_memory_source(decode_elsewhere) is None
    assert decode_batches.batch_memory_source(decode_both) is None
    assert decode_batches.batch_memory_source(len) is None  # no Python code to read


def _vae(decode, patcher_free=None):
    cls = type("VAE", (), {"decode": decode})
    vae = cls()
    vae.device = "cuda:0"
    vae.patcher = types.SimpleNamespace(get_free_memory=lambda device: patcher_free)
    return vae


def test_free_memory_comes_from_where_the_decode_asks(monkeypatch):
    fake = types.ModuleType("comfy.model_management")
    fake.get_free_memory = lambda device: 3.0
    comfy = types.ModuleType("comfy")
    comfy.model_management = fake
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)
    assert decode_batches.free_memory_for_batches(_vae(decode_033, patcher_free=7.0)) == 7.0
    assert decode_batches.free_memory_for_batches(_vae(decode_08, patcher_free=7.0)) == 3.0
    assert decode_batches.unknown_batch_split_reason(_vae(decode_033)) is None
    assert "does not know" in decode_batches.unknown_batch_split_reason(_vae(decode_elsewhere))
