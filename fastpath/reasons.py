"""Reasons the fast path steps aside: the helpers every family's checks share.

A reason is a short string for the UI text and the log (None: no reason, go fast). Checks
list their reasons in order and the first one counts; the most frequent one summarises many.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from ..kernels.accepts import Accepts

AUTOGRAD = "autograd (the fused kernels have no backward)"


def first_reason(*reasons: str | None) -> str | None:
    """The first reason that is not None."""
    return next((r for r in reasons if r is not None), None)


def most_common(reasons: Iterable[str] | Counter) -> str:
    """The most frequent reason (a ``Counter`` or the reasons themselves); the first one seen
    wins a tie."""
    counts = reasons if isinstance(reasons, dict) else Counter(reasons)
    return max(counts, key=counts.get)


def input_reason(x: object, accepts: Accepts, rank: int | None = None) -> str | None:
    """Per-call checks on a fused module's input: a tensor the kernel declaration ``accepts``
    takes, apart from the layout (the fast path makes it channels-last itself) and the channel
    rules (checked at install); ``rank`` narrows the ranks to the module's own; not empty; no
    autograd."""
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    reason = accepts.tensor_reason(x, layout=False, rank=rank)
    if reason is not None:
        return reason
    if x.numel() == 0:  # a module's fast path needs data even where its kernel would not
        return "empty tensor"
    if torch.is_grad_enabled() and x.requires_grad:
        return AUTOGRAD
    return None
