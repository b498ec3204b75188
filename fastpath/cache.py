"""Folded weights are caches, not weights.

They are built lazily on the first fast decode, live in a plain attribute of the module that
owns them (never a Parameter or buffer, so never in the state dict and never moved by
``.to()``), are rebuilt when their source tensors change, and are dropped by
``drop_fast_path_caches`` when ComfyUI unloads the model.

"Change" is seen three ways: another tensor object (ComfyUI's ``set_attr_param`` replaces
Parameters; a weak reference tells a new object from an old one at a reused address), a bumped
version counter (in-place writes outside inference mode), and ``load_state_dict`` into the
owning module (a post-hook drops its entries). The last is needed because ComfyUI runs under
``torch.inference_mode()``, where Parameters are inference tensors without a version counter,
so values copied into them in place leave no trace on the tensor. Other in-place writes into
inference-tensor weights (not something ComfyUI does to a VAE) are not seen.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

_ATTR = "_fvd_cache"
_HOOKED = "_fvd_cache_load_hook"

# Bumped whenever a kept value is built or dropped anywhere: a CUDA graph (``cuda_graph.py``)
# reads the folds at the addresses they had when it was captured, and is replayed only while
# this is what it was then.
_GENERATION = [0]


def generation() -> int:
    return _GENERATION[0]


def _bump() -> None:
    _GENERATION[0] += 1


def _drop_store(module: torch.nn.Module) -> int:
    """Drop ``module``'s kept values; a value with a ``forget()`` (a graph set) is told first."""
    store = module.__dict__.pop(_ATTR, None)
    if not store:
        return 0
    _bump()
    for entry in store.values():
        forget = getattr(entry[1], "forget", None)
        if callable(forget):
            forget()
    return len(store)


def _fingerprint(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    # Inference tensors (ComfyUI loads models under inference_mode) have no version counter.
    # Asked first: reading ``_version`` and catching its RuntimeError took 6.9 us a call on
    # the host, against 0.4 us (CPython 3.11), on a path LTX runs 112 times a decode.
    version = -1 if t.is_inference() else t._version
    return (t.data_ptr(), version, t.dtype, t.device, tuple(t.shape))


def _same_objects(refs: tuple, sources: tuple) -> bool:
    return all((t is None) if r is None else (r() is t) for r, t in zip(refs, sources, strict=True))


def _drop_after_load(module: torch.nn.Module, incompatible_keys) -> None:
    # Runs after the module's whole subtree took its new values (torch calls post-hooks after
    # the children), so every source of this module's folds may have changed.
    _drop_store(module)


def _hook_state_dict_loads(module: torch.nn.Module) -> None:
    register = getattr(module, "register_load_state_dict_post_hook", None)
    if register is not None and not module.__dict__.get(_HOOKED):
        register(_drop_after_load)
        module.__dict__[_HOOKED] = True


def cached(module: torch.nn.Module, name: str, sources: tuple, build: Callable[[], object],
           extra_key: tuple = (), keep: bool = True, bump: bool = True) -> object:
    """``build()`` once per (source tensors, extra_key); later calls return the cached value.

    ``keep=False`` (sources that are per-call copies, see ``comfyui.weights.is_stable``) builds
    the value for this call only and drops any kept one: a fold of a copy that dies with the
    call would never be hit again and would only hold memory.

    ``bump=False``: building the value leaves the fold generation as it is, for a value that
    every reader fetches per call (never one a CUDA graph reads behind its weight fingerprint).
    """
    if not keep:
        store = module.__dict__.get(_ATTR)
        if store is not None and store.pop(name, None) is not None and bump:
            _bump()
        return build()
    store = module.__dict__.get(_ATTR)
    if store is None:
        _hook_state_dict_loads(module)
        store = module.__dict__[_ATTR] = {}
    key = tuple(_fingerprint(t) for t in sources) + tuple(extra_key)
    hit = store.get(name)
    if hit is not None and hit[0] == key and _same_objects(hit[2], sources):
        return hit[1]
    store.pop(name, None)  # free the stale copy before building the new one
    if bump:
        _bump()
    value = build()
    refs = tuple(None if t is None else weakref.ref(t) for t in sources)
    store[name] = (key, value, refs)
    return value


def kept(module: torch.nn.Module, name: str, make: Callable[[], object]) -> object:
    """A value kept with ``module``'s folds (dropped with them) that checks its own validity
    (``cuda_graph``'s graph set); made once."""
    store = module.__dict__.get(_ATTR)
    if store is None:
        _hook_state_dict_loads(module)
        store = module.__dict__[_ATTR] = {}
    entry = store.get(name)
    if entry is None:
        entry = store[name] = (None, make(), ())
    return entry[1]


def kept_values(model: torch.nn.Module, name: str) -> list:
    return [m.__dict__[_ATTR][name][1] for m in model.modules()
            if name in m.__dict__.get(_ATTR, {})]


def cache_bytes(model: torch.nn.Module) -> int:
    """Bytes held by fast-path caches under ``model`` (for tests and the benchmark)."""
    total = 0
    for m in model.modules():
        for entry in m.__dict__.get(_ATTR, {}).values():
            value = entry[1]
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def drop_fast_path_caches(model: torch.nn.Module) -> int:
    """Drop every lazily built fast-path buffer under ``model``; returns how many were dropped."""
    return sum(_drop_store(m) for m in model.modules())
