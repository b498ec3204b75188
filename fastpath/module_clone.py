"""An independent copy of an ``nn.Module`` tree with new tensors (other dtype/device).

``copy.deepcopy`` is wrong here: it copies tensors where they are (a GPU-resident VAE would be
duplicated on the GPU), carries ComfyUI's per-model bookkeeping (``model_loaded_weight_memory``
says "already loaded" to a new ``ModelPatcher``), and the fast path's class swaps, gates and
caches (a gate holds a ``threading.local``). This copies the structure module by module:

- every module gets its stock class back (un-swapped) and a shallow copy of its attributes;
  containers (dicts, lists, sets) are copied so the two trees never share mutable state;
- attributes a ``ModelPatcher`` or the fast path set on the source are left out, and ComfyUI's
  per-call casting flags are restored to what they were before a low-VRAM load;
- parameters and buffers become new tensors made by ``make_tensor(path, tensor)``;
- a child for which ``share(path)`` is true is the same object in both trees.
"""
from __future__ import annotations

from typing import Callable

import torch

from .swap import stock_class

# Set on a model or its modules by ComfyUI's ModelPatcher (both supported trees); a copy must
# start unloaded, so its own patcher sets them afresh.
PATCHER_ATTRS = frozenset({
    "model_loaded_weight_memory", "lowvram_patch_counter", "model_lowvram",
    "current_weight_patches_uuid", "model_offload_buffer_memory", "device", "current_patcher",
    "skip_injection", "comfy_patched_weights", "prev_comfy_cast_weights",
    # Newer ComfyUI's dynamic VRAM (ModelPatcherDynamic.load, comfy.ops' vbar cast, and
    # comfy.pinned_memory) keeps per-module handles into the source model's VRAM area and
    # pinned host buffers; a copy sharing them would cast the source's bytes as its weights.
    "_v", "seed_key", "pin_failed", "weight_lowvram_function", "bias_lowvram_function",
    # ... and on the model itself its VRAM areas, pinned host buffers and the patchers using
    # them: a copy sharing these would allocate its slots in the source's area.
    "dynamic_vbars", "dynamic_pins", "dynamic_patchers",
})
PATCHER_PREFIXES = ("_v_", "_pin")  # _v_signature, _v_weight, _v_bias, _pin, _pin_state, ...


def _set_by_patcher(key: str) -> bool:
    return key in PATCHER_ATTRS or key.startswith(PATCHER_PREFIXES)


def _copy_value(value):
    if isinstance(value, dict):
        return type(value)(value) if type(value) is not dict else dict(value)
    if isinstance(value, (list, set)):
        return type(value)(value)
    return value


def clone_module(module: torch.nn.Module,
                 make_tensor: Callable[[str, torch.Tensor], torch.Tensor],
                 share: Callable[[str], bool] = lambda path: False,
                 prefix: str = "") -> torch.nn.Module:
    """A copy of ``module`` whose parameters/buffers are ``make_tensor(path, t)``."""
    cls = stock_class(module)
    new = cls.__new__(cls)
    attrs = {}
    for key, value in module.__dict__.items():
        if key.startswith("_fvd") or _set_by_patcher(key):
            continue
        if key == "_parameters":
            value = type(value)(
                (n, None if p is None else torch.nn.Parameter(
                    make_tensor(prefix + n, p), requires_grad=p.requires_grad))
                for n, p in value.items())
        elif key == "_buffers":
            value = type(value)(
                (n, None if b is None else make_tensor(prefix + n, b)) for n, b in value.items())
        elif key == "_modules":
            value = type(value)(
                (n, c if c is None or share(prefix + n) else
                 clone_module(c, make_tensor, share, prefix + n + "."))
                for n, c in value.items())
        else:
            value = _copy_value(value)
        attrs[key] = value
    if "prev_comfy_cast_weights" in module.__dict__:  # a low-VRAM load forced casting; undo
        attrs["comfy_cast_weights"] = module.__dict__["prev_comfy_cast_weights"]
    elif "_v" in module.__dict__ or "seed_key" in module.__dict__:
        # The dynamic loader forces casting without keeping the old value: the class default
        # (ComfyUI's ops declare it there) is what an unloaded module has.
        attrs.pop("comfy_cast_weights", None)
    for key in ("weight_function", "bias_function"):  # per-call patches belong to the source
        if key in attrs:
            attrs[key] = []
    new.__dict__.update(attrs)
    return new


def tensor_copier(device: torch.device | str, dtype_for: Callable[[str], torch.dtype | None]):
    """``make_tensor`` that copies to ``device``; floating tensors to ``dtype_for(path)``.

    Runs outside inference mode so the copies are ordinary tensors whatever the source was
    (ComfyUI loads and runs models under ``torch.inference_mode``).
    """
    def make(path: str, t: torch.Tensor) -> torch.Tensor:
        dtype = dtype_for(path) if t.is_floating_point() else None
        with torch.inference_mode(False), torch.no_grad():
            return t.detach().to(device=device, dtype=dtype or t.dtype, copy=True)
    return make
