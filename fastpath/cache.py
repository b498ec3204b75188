"""Folded weights are caches, not weights.

They are built lazily on the first fast decode, live in a plain attribute of the module that
owns them (never a Parameter or buffer, so never in the state dict and never moved by
``.to()``), are rebuilt when their source tensors change, and are dropped by
``drop_fast_path_caches`` when ComfyUI unloads the model.
"""
from __future__ import annotations

from typing import Callable

import torch

_ATTR = "_fvd_cache"


def _fingerprint(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    try:
        version = t._version
    except RuntimeError:  # inference tensors (ComfyUI loads models under inference_mode) have none
        version = -1
    return (t.data_ptr(), version, t.dtype, t.device, tuple(t.shape))


def cached(module: torch.nn.Module, name: str, sources: tuple, build: Callable[[], object],
           extra_key: tuple = ()) -> object:
    """``build()`` once per (source tensors, extra_key); later calls return the cached value."""
    store = module.__dict__.setdefault(_ATTR, {})
    key = tuple(_fingerprint(t) for t in sources) + tuple(extra_key)
    hit = store.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    store.pop(name, None)  # free the stale copy before building the new one
    value = build()
    store[name] = (key, value)
    return value


def cache_bytes(model: torch.nn.Module) -> int:
    """Bytes held by fast-path caches under ``model`` (for tests and the benchmark)."""
    total = 0
    for m in model.modules():
        for _, value in m.__dict__.get(_ATTR, {}).values():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def drop_fast_path_caches(model: torch.nn.Module) -> int:
    """Drop every lazily built fast-path buffer under ``model``; returns how many were dropped."""
    dropped = 0
    for m in model.modules():
        store = m.__dict__.pop(_ATTR, None)
        if store:
            dropped += len(store)
    return dropped
