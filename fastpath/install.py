"""Install the fast path once per loaded model, dispatching by VAE family.

A family recognises a model and swaps fused classes into its modules. Installing is in place
and idempotent, leaves the state dict untouched, and fails closed per module: a module the
family cannot take is left stock and the reason is recorded in the report, which the node
shows in its UI text and the log shows once.
"""
from __future__ import annotations

import threading
import weakref

import torch

from . import families as _builtin_families  # noqa: F401  (each family registers on import)
from .contract import Family, InstallReport, register_family, registered_families, unregister_family
from .fused import arm_prewarm
from .gate import gate_for
from .log import say

__all__ = ["Family", "InstallReport", "register_family", "unregister_family", "families",
           "find_family", "install_fast_path", "install_report"]

_REPORTS: "weakref.WeakKeyDictionary[torch.nn.Module, InstallReport]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def families() -> list[Family]:
    return registered_families()


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
                arm_prewarm(gate_for(model), model)
        _REPORTS[model] = report
        # Unkeyed: this branch runs once per model (the report is kept), and an id() key would
        # silence a later model at a freed one's address.
        say(f"{type(model).__name__}: {report.summary()}")
        return report


def install_report(model: torch.nn.Module) -> InstallReport | None:
    return _REPORTS.get(model)
