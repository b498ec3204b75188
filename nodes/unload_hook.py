"""Drop the fast path's lazily built buffers when ComfyUI unloads or cleans up a VAE."""
from __future__ import annotations

from ..fastpath.cache import drop_fast_path_caches

HOOK_KEY = "fast_vae_decode.drop_caches"


def _drop_on_detach(patcher, unpatch_all=True) -> None:
    # ComfyUI also detaches a model it keeps loaded: ``load_models_gpu`` pops the loaded entry
    # and calls ``detach(unpatch_all=False)`` at the start of every decode with it, and a
    # patcher being garbage-collected does the same. The weights stay where they are then, so
    # the folds stay valid; only an unpatching detach (an unload) frees them.
    if unpatch_all:
        drop_fast_path_caches(patcher.model)


def _drop_on_cleanup(patcher) -> None:
    drop_fast_path_caches(patcher.model)


def ensure_unload_hook(vae: object) -> bool:
    """Register the hook once per VAE patcher; returns True when it registered it now."""
    patcher = getattr(vae, "patcher", None)
    if patcher is None or not hasattr(patcher, "add_callback_with_key"):
        return False
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return False
    callbacks = getattr(patcher, "callbacks", {})
    if HOOK_KEY in callbacks.get(CallbacksMP.ON_DETACH, {}):
        return False
    patcher.add_callback_with_key(CallbacksMP.ON_DETACH, HOOK_KEY, _drop_on_detach)
    cleanup = getattr(CallbacksMP, "ON_CLEANUP", None)  # absent in some older trees
    if cleanup is not None:
        patcher.add_callback_with_key(cleanup, HOOK_KEY, _drop_on_cleanup)
    return True
