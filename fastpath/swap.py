"""Install fused behaviour by swapping a module's class for a subclass of it.

A swapped module keeps its own ``__dict__``: the same ``Parameter`` objects under the same
names, the same buffers and children, so the state dict, ``load_state_dict``, ``.to()`` and
``isinstance`` checks are all unchanged. The subclass's ``forward`` takes the fast path only
while the model's gate is open and otherwise calls the stock ``forward`` (``super()``), which is
what makes the closed gate bit-exact.
"""
from __future__ import annotations

import threading

import torch

_SUBCLASSES: dict[tuple[type, type], type] = {}
_LOCK = threading.Lock()


def fused_class(mixin: type, base: type) -> type:
    """The (cached) subclass ``mixin + base``; cached so every swapped module of a base shares it."""
    key = (mixin, base)
    with _LOCK:
        cls = _SUBCLASSES.get(key)
        if cls is None:
            cls = type(
                f"{mixin.__name__}[{base.__name__}]",
                (mixin, base),
                {"__module__": mixin.__module__, "_fvd_stock_class": base},
            )
            _SUBCLASSES[key] = cls
        return cls


def swapped_stock_class(module: object) -> type | None:
    """The stock class a swapped module came from; None for a module that was never swapped."""
    return type(module).__dict__.get("_fvd_stock_class")


def stock_class(module: object) -> type:
    """``module``'s stock class: the one it came from once swapped, else its own."""
    return swapped_stock_class(module) or type(module)


def is_swapped(module: torch.nn.Module) -> bool:
    return swapped_stock_class(module) is not None


def swap_in(module: torch.nn.Module, mixin: type, **attrs) -> bool:
    """Give ``module`` the fused behaviour of ``mixin`` and set ``attrs`` on it.

    A module that already has exactly this fused class (a deep copy of an installed model, or
    a second install) keeps it and gets ``attrs`` again, so a copy's modules follow the copy's
    own gate; False when the module carries another fused class.
    """
    stock = swapped_stock_class(module)
    if stock is not None and type(module) is not fused_class(mixin, stock):
        return False
    if stock is None:
        module.__class__ = fused_class(mixin, type(module))
    for name, value in attrs.items():
        # Plain attributes (never Parameters/buffers/Modules): invisible to the state dict.
        object.__setattr__(module, name, value)
    return True


def swap_reason(module: torch.nn.Module, mixin: type, **attrs) -> str | None:
    """``swap_in``, with the reason it did not happen (None when ``module`` has ``mixin`` now)."""
    if swap_in(module, mixin, **attrs):
        return None
    return f"already carries another fused class ({type(module).__name__})"
