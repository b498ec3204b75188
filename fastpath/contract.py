"""The contract between the framework and a VAE family, and the registry of families.

A ``Family`` recognises a model (``matches``) and swaps fused classes into it (``install``),
recording what it did in an ``InstallReport``. Families register themselves on import; the
built-in ones live in ``families/<name>/``. This module imports no family, so a family importing
it closes no circle.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .gate import Gate
from .reasons import most_common


@dataclass
class InstallReport:
    """What an install did: which family, how many fused modules, what was left stock and why."""

    family: str | None = None
    fused: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # module path -> reason
    reason: str | None = None  # why nothing at all was installed

    @property
    def installed(self) -> bool:
        return self.fused > 0

    def summary(self) -> str:
        if not self.installed:
            return f"not installed: {self.reason or 'no module could be fused'}"
        text = f"{self.family}: {self.fused} fused modules"
        if self.skipped:
            text += f", {len(self.skipped)} left stock ({most_common(self.skipped.values())})"
        return text

    def record(self, path: str, reason: str | None) -> None:
        """One module's outcome: fused (no reason), or left stock for ``reason``."""
        if reason is None:
            self.fused += 1
        else:
            self.skipped[path] = reason


@dataclass(frozen=True)
class Family:
    """A VAE family: ``matches(model)`` recognises it, ``install(model, gate, report)`` swaps."""

    name: str
    matches: Callable[[torch.nn.Module], bool]
    install: Callable[[torch.nn.Module, Gate, InstallReport], None]


_FAMILIES: list[Family] = []
_LOCK = threading.RLock()


def register_family(family: Family) -> None:
    """Add a family (first match wins); re-registering a name replaces it."""
    with _LOCK:
        _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
        _FAMILIES.append(family)


def unregister_family(name: str) -> None:
    with _LOCK:
        _FAMILIES[:] = [f for f in _FAMILIES if f.name != name]


def registered_families() -> list[Family]:
    """The families registered so far, in match order (``install.families`` loads the built-ins)."""
    with _LOCK:
        return list(_FAMILIES)
