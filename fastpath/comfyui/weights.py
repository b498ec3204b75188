"""How ComfyUI's ``comfy.ops`` modules may compute with something other than their raw weights.

Low-VRAM modes set ``comfy_cast_weights`` and cast or stream the weights inside the stock
``forward``; dynamic VRAM (newer ComfyUI, ``ModelPatcher.is_dynamic()``) also sets it and
faults the weights into a VRAM slot per call (``_v``/``_v_signature`` on the module); LoRA-style
patches add ``weight_function``s. A fused module reads ``module.weight`` directly, so any of
these sends it to its stock path. Attributes are read without ``nn.Module.__getattr__``, whose
AttributeError for a missing name is slow on a per-call path.
"""
from __future__ import annotations

import torch

_MISSING = object()

LOW_VRAM = "weights cast per call (ComfyUI low-VRAM mode)"
DYNAMIC_VRAM = "weights streamed per call (ComfyUI dynamic VRAM)"
PATCHES = "ComfyUI weight patches"


def module_attr(module: torch.nn.Module, name: str, default=None):
    """Instance attribute (set by ComfyUI's patcher) or class attribute (ComfyUI's ops classes)."""
    value = module.__dict__.get(name, _MISSING)
    return getattr(type(module), name, default) if value is _MISSING else value


def comfy_cast_reason(module: torch.nn.Module) -> str | None:
    """Why ComfyUI's ops would compute ``module`` differently from its raw weights."""
    if module_attr(module, "comfy_cast_weights", False):
        state = module.__dict__
        return DYNAMIC_VRAM if ("_v" in state or "_v_signature" in state) else LOW_VRAM
    if module_attr(module, "weight_function") or module_attr(module, "bias_function"):
        return PATCHES
    return None
