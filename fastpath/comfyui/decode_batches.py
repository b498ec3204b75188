"""How ComfyUI's ``VAE.decode`` sizes its batch split: whose free memory it divides by.

A decode the pack runs in place of ``VAE.decode`` (``pixels.decode``) must put the same latents
in each pass: another batch size is other convolutions (cuDNN may pick other kernels, so other
roundings, for it), and lossless is bit-exact with ``VAEDecode`` only pass for pass.

Read off the method's own code, never a version: through 0.8 it asks
``model_management.get_free_memory(device)``; 0.33 and newer ask the VAE's patcher
(``ModelPatcher.get_free_memory``), which adds what dynamic VRAM could evict from other models
to what torch has free, several times more room while a diffusion model is resident. Code that
asks anything else is not known, and such a VAE keeps ComfyUI's own decode.
"""
from __future__ import annotations

import dis
import functools
from types import CodeType

PATCHER = "patcher"
MODEL_MANAGEMENT = "model_management"


def _asks(code: CodeType) -> str | None:
    """PATCHER or MODEL_MANAGEMENT: the one owner of every ``get_free_memory`` the code calls
    (the name loaded just before the method); None for none, several or another owner."""
    owners, before = set(), None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "get_free_memory":
            owners.add(None if before is None else before.argval)
        before = ins
    return owners.pop() if len(owners) == 1 and owners <= {PATCHER, MODEL_MANAGEMENT} else None


@functools.lru_cache(maxsize=8)  # by the function's identity: read once per decode method
def batch_memory_source(decode) -> str | None:
    """Whose free memory ``decode`` (a ``VAE.decode`` function) sizes its batches by."""
    code = getattr(decode, "__code__", None)
    return _asks(code) if isinstance(code, CodeType) else None


def unknown_batch_split_reason(vae) -> str | None:
    """Why the pack cannot size ``vae``'s batch split as its ``VAE.decode`` would (None: it can)."""
    if batch_memory_source(type(vae).decode) is None:
        return "its VAE.decode sizes the batch split by a free-memory query this pack does not know"
    return None


def free_memory_for_batches(vae) -> float:
    """The free memory ``vae``'s own ``VAE.decode`` would divide by (``unknown_batch_split_reason``
    said it is known)."""
    if batch_memory_source(type(vae).decode) == PATCHER:
        return vae.patcher.get_free_memory(vae.device)
    import comfy.model_management as mm

    return mm.get_free_memory(vae.device)
