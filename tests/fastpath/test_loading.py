"""When a decode may skip ComfyUI's ``load_models_gpu`` (``fastpath.comfyui.loading``), on
stand-ins for the ComfyUI state it reads (tier 1; tier 2 runs it against a real tree)."""
from __future__ import annotations

import sys
import types
import uuid

import pytest

from fast_vae_decode.fastpath.comfyui import loading

GIB = 1 << 30


class _Entry:
    """Stands in for ``comfy.model_management.LoadedModel``."""

    def __init__(self, model):
        self.model, self.currently_used, self.dead = model, False, False

    def is_dead(self):
        return self.dead


class _Patcher:
    """The attributes of a ``ModelPatcherDynamic`` that the check reads."""

    def __init__(self, dynamic=True):
        self.dynamic = dynamic
        self.load_device = "cuda:0"
        self.patches_uuid = uuid.uuid4()
        self.backup = {"a.weight": None}
        self.callbacks = {}
        self.injections = {}
        self.forced_hooks = None
        self.extra_models = []
        self.model = types.SimpleNamespace(
            current_weight_patches_uuid=None, model_loaded_weight_memory=1024, device="cpu",
            dynamic_pins={"cuda:0": {"active": False, "failed": False}})

    def is_dynamic(self):
        return self.dynamic

    def model_patches_models(self):
        return self.extra_models

    def get_all_callbacks(self, kind):
        return [c for cs in self.callbacks.get(kind, {}).values() for c in cs]


class _MM(types.ModuleType):
    """Stands in for ``comfy.model_management``: ``load_models_gpu`` does what a dynamic
    load leaves behind (the entry first, current patches, on the device, pins active)."""

    def __init__(self):
        super().__init__("comfy.model_management")
        self.current_loaded_models, self.loads, self.free = [], 0, 100 * GIB

    def load_models_gpu(self, models, memory_required=0, force_full_load=False):
        self.loads += 1
        patcher = models[0]
        entries = [e for e in self.current_loaded_models if e.model is patcher]
        entry = entries[0] if entries else _Entry(patcher)
        self.current_loaded_models[:] = [entry] + [e for e in self.current_loaded_models
                                                  if e is not entry]
        patcher.model.current_weight_patches_uuid = patcher.patches_uuid
        patcher.model.device = patcher.load_device
        pins = getattr(patcher.model, "dynamic_pins", None)
        if pins is not None:
            pins[patcher.load_device]["active"] = True

    def minimum_inference_memory(self):
        return GIB

    def extra_reserved_memory(self):
        return GIB // 2

    def get_free_memory(self, device=None):
        return self.free


@pytest.fixture()
def mm(monkeypatch):
    fake = _MM()
    comfy = types.ModuleType("comfy")
    comfy.model_management = fake
    extension = types.ModuleType("comfy.patcher_extension")
    extension.CallbacksMP = types.SimpleNamespace(ON_LOAD="on_load_after")
    comfy.patcher_extension = extension
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", extension)
    return fake


def _decode(patcher, memory=GIB):
    return loading.load_for_decode(types.SimpleNamespace(patcher=patcher), memory)


def test_a_second_decode_of_an_unchanged_dynamic_vae_skips_the_load(mm):
    patcher = _Patcher()
    assert _decode(patcher) is None and mm.loads == 1  # the first decode always loads
    mm.current_loaded_models[0].currently_used = False
    assert _decode(patcher) is not None and mm.loads == 1
    # What load_models_gpu would have done for a loaded model, it still does.
    assert mm.current_loaded_models[0].currently_used


def test_the_legacy_patcher_always_loads(mm):
    patcher = _Patcher(dynamic=False)
    _decode(patcher)
    _decode(patcher)
    assert mm.loads == 2


def _another_model_loaded(mm, patcher):
    mm.load_models_gpu([_Patcher()])


def _patches_changed(mm, patcher):
    patcher.patches_uuid = uuid.uuid4()


def _weights_restored_to_host(mm, patcher):  # a partial unload restores force-loaded weights
    patcher.model.model_loaded_weight_memory = 0
    patcher.backup.clear()


def _unloaded(mm, patcher):
    mm.current_loaded_models.clear()


def _entry_dead(mm, patcher):
    mm.current_loaded_models[0].dead = True


def _moved_off_device(mm, patcher):
    patcher.model.device = "cpu"


def _pins_failed(mm, patcher):
    patcher.model.dynamic_pins["cuda:0"]["failed"] = True


def _load_callback(mm, patcher):
    patcher.callbacks["on_load_after"] = {None: [lambda *a: None]}


def _patch_model(mm, patcher):
    patcher.extra_models.append(_Patcher())


def _injection(mm, patcher):
    patcher.injections["x"] = [object()]


def _no_room(mm, patcher):
    mm.free = 2 * GIB  # less than the decode (1 GiB) + inference (1) + reserve (0.5)


def _older_tree(mm, patcher):
    del patcher.model.dynamic_pins


@pytest.mark.parametrize("change", [
    _another_model_loaded, _patches_changed, _weights_restored_to_host, _unloaded,
    _entry_dead, _moved_off_device, _pins_failed, _load_callback, _patch_model, _injection,
    _no_room, _older_tree])
def test_any_change_since_the_last_load_loads_again(mm, change):
    patcher = _Patcher()
    _decode(patcher)
    change(mm, patcher)
    reason = loading.resident_reason(mm, patcher, GIB)
    assert reason, change.__name__
    assert _decode(patcher) is None and mm.loads >= 2


def test_a_load_by_comfyui_itself_is_not_taken_for_the_packs(mm):
    """Only a load this pack made (and saw the result of) can be skipped afterwards."""
    patcher = _Patcher()
    mm.load_models_gpu([patcher])  # e.g. the stock VAEDecode node
    assert loading.resident_reason(mm, patcher, GIB) == "not loaded by this pack yet"
