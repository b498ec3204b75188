"""Loading a VAE for one decode: ComfyUI's ``load_models_gpu``, unless it would change nothing.

Under dynamic VRAM (``ModelPatcherDynamic``: ``is_dynamic()`` is True) every
``load_models_gpu`` call re-prepares the whole model, even when it is the model loaded last and
nothing about it changed: it detaches it, walks every module, restores the small weights it
force-loads from their backups and copies them to the device again, and re-casts its buffers.
Measured on an H200 (ComfyUI 0.33): 21.9 ms for the SDXL VAE and 23.5 ms for the Wan 2.1 VAE on
every decode, about as long as the fused SDXL decode itself. The legacy patcher's load of an
already loaded model returns at once (0.5 ms).

``load_for_decode`` calls ComfyUI's ``load_models_gpu`` exactly as its ``VAE.decode`` does,
and records what that load left behind. A later decode skips the call only while ComfyUI's own
state shows that the load would re-create what is there:
- the VAE's entry is the one that load left, still first in ``current_loaded_models`` (nothing
  was loaded since, so nothing was evicted for another model and the VAE's VRAM area is still
  the one ComfyUI prioritised last);
- no weight patches changed (``patches_uuid``), no weights were restored to host memory
  (``model_loaded_weight_memory`` and the backups are as the load left them), the model is on
  its load device, and its pinned host buffers are active;
- the model has no extra patch models, load callbacks, injections or forced hooks, which a load
  runs or re-applies each time;
- the device has room for the decode (what ComfyUI's load would otherwise free for it).
Weights of a dynamic model are fetched into VRAM per call by ComfyUI's ops either way, so a
skipped load changes no value: lossless stays bit-exact. Anything else - a non-dynamic
patcher, an older tree without these attributes, any doubt - calls ComfyUI.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple


class _Loaded(NamedTuple):
    entry: weakref.ref  # to the LoadedModel ComfyUI put first after the load (held weakly: it
    # holds the patcher, which keys the record)
    patches_uuid: object
    weight_memory: int
    backups: int


# patcher -> what its last ComfyUI load left; weak, so a dropped VAE takes its record along.
_last_load: "weakref.WeakKeyDictionary[object, _Loaded]" = weakref.WeakKeyDictionary()


def _state(patcher, entry) -> _Loaded:
    return _Loaded(weakref.ref(entry), patcher.patches_uuid, patcher.model.model_loaded_weight_memory,
                   len(patcher.backup))


def _on_load_callbacks(patcher) -> list:
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return [None]
    return patcher.get_all_callbacks(CallbacksMP.ON_LOAD)


def resident_reason(mm, patcher, memory_required: float) -> str | None:
    """Why ``load_models_gpu`` must run for this decode (None: it would change nothing)."""
    try:
        if not patcher.is_dynamic():
            return "not dynamic VRAM (ComfyUI's own load returns at once when loaded)"
        last = _last_load.get(patcher)
        if last is None:
            return "not loaded by this pack yet"
        loaded, entry = mm.current_loaded_models, last.entry()
        if entry is None or not loaded or loaded[0] is not entry or entry.model is not patcher \
                or entry.is_dead():
            return "another model was loaded since"
        model = patcher.model
        if model.current_weight_patches_uuid != patcher.patches_uuid or \
                _state(patcher, entry)[1:] != last[1:]:
            return "its weights or patches changed since"
        if model.device != patcher.load_device:
            return "not on its load device"
        pins = model.dynamic_pins[patcher.load_device]
        if not pins["active"] or pins["failed"]:
            return "its pinned host buffers are not active"
        if patcher.model_patches_models() or _on_load_callbacks(patcher) or \
                getattr(patcher, "injections", None) or patcher.forced_hooks:
            return "it has load callbacks, patch models, injections or hooks"
        room = memory_required + mm.minimum_inference_memory() + mm.extra_reserved_memory()
        if mm.get_free_memory(patcher.load_device) < room:
            return "the device lacks free memory for the decode"
    except (AttributeError, KeyError, TypeError) as error:
        return f"this ComfyUI keeps other loading state ({type(error).__name__}: {error})"
    return None


def load_for_decode(vae, memory_required: float, force_full_load: bool = False) -> str | None:
    """Load ``vae`` for a decode needing ``memory_required`` bytes, as ``VAE.decode`` does.

    Returns None when ComfyUI's ``load_models_gpu`` ran, else why it could be skipped.
    """
    import comfy.model_management as mm

    patcher = vae.patcher
    if resident_reason(mm, patcher, memory_required) is None:
        mm.current_loaded_models[0].currently_used = True  # as load_models_gpu marks it
        return "already loaded for dynamic VRAM, unchanged"
    mm.load_models_gpu([patcher], memory_required=memory_required,
                       force_full_load=force_full_load)
    loaded = mm.current_loaded_models
    try:
        if loaded and loaded[0].model is patcher and patcher.is_dynamic():
            _last_load[patcher] = _state(patcher, loaded[0])
        else:
            _last_load.pop(patcher, None)
    except (AttributeError, TypeError):
        _last_load.pop(patcher, None)
    return None
