"""Install the fast path once per loaded model, dispatching by VAE family.

A family recognises a model and swaps fused classes into its modules. Installing is in place
and idempotent, leaves the state dict untouched, and fails closed per module: a module the
family cannot take is left stock and the reason is recorded in the report, which the node
shows in its UI text and the log shows once.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .gate import Gate, gate_for
from .log import log_once
from .prewarm import arm


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
            text += f", {len(self.skipped)} left stock ({_most_common(self.skipped.values())})"
        return text


def _most_common(reasons) -> str:
    counts: dict[str, int] = {}
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
    return max(counts, key=counts.get)


@dataclass(frozen=True)
class Family:
    """A VAE family: ``matches(model)`` recognises it, ``install(model, gate, report)`` swaps."""

    name: str
    matches: Callable[[torch.nn.Module], bool]
    install: Callable[[torch.nn.Module, Gate, InstallReport], None]


_FAMILIES: list[Family] = []
_REPORTS: "weakref.WeakKeyDictionary[torch.nn.Module, InstallReport]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def register_family(family: Family) -> None:
    """Add a family (first match wins); re-registering a name replaces it."""
    with _LOCK:
        _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
        _FAMILIES.append(family)


def unregister_family(name: str) -> None:
    with _LOCK:
        _FAMILIES[:] = [f for f in _FAMILIES if f.name != name]


def families() -> list[Family]:
    _load_builtin_families()
    return list(_FAMILIES)


_BUILTINS_LOADED = False


def _load_builtin_families() -> None:
    """Import the built-in family modules once; each registers itself on import."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from . import families as _builtin  # noqa: F401  (registration side effect)


def find_family(model: torch.nn.Module) -> Family | None:
    for family in families():
        try:
            if family.matches(model):
                return family
        except Exception:  # a recogniser must never break a decode
            continue
    return None


def install_fast_path(model: torch.nn.Module) -> InstallReport:
    """Install fused modules into ``model`` once; later calls return the first report."""
    with _LOCK:
        report = _REPORTS.get(model)
        if report is not None:
            return report
        report = InstallReport()
        family = find_family(model)
        if family is None:
            report.reason = f"unsupported VAE ({type(model).__name__})"
        else:
            report.family = family.name
            try:
                family.install(model, gate_for(model), report)
            except Exception as exc:  # fail closed: a half-done install is still exact when closed
                report.reason = f"install failed ({type(exc).__name__}: {exc})".splitlines()[0]
            if report.fused == 0 and report.reason is None:
                report.reason = "no module could be fused"
            if report.fused:
                arm(gate_for(model), model)
        _REPORTS[model] = report
        log_once(f"install:{id(model)}", f"{type(model).__name__}: {report.summary()}")
        return report


def install_report(model: torch.nn.Module) -> InstallReport | None:
    return _REPORTS.get(model)
