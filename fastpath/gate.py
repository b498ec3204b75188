"""The per-model gate the fused modules read on every forward.

One ``Gate`` per VAE model, held in a ``WeakKeyDictionary`` so a gate never keeps a freed VAE
alive. The gate is closed by default: an installed model decodes exactly like stock until a
caller opens the gate for one decode with ``with gate.opened(True):``, which always restores
the previous state (nested use, exceptions).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class RunStats:
    """What happened inside one open gate: fused calls, per-reason fallbacks, kernel errors."""

    fused_calls: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    # Fused modules whose fast path raised during this decode (each is disabled from then on);
    # the decode's result mixes fast and stock layers, so the caller re-runs it stock.
    kernel_errors: list[str] = field(default_factory=list)

    def fell_back(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class Gate:
    """Open/closed switch for one model's fused modules.

    The state is per thread: ComfyUI runs one prompt at a time on its worker thread, but a
    second thread (a test, another server) decoding with the same model must never see a gate
    it did not open.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        # Fused modules whose kernels the first fused call compiles in parallel (prewarm.py).
        self.prewarm_modules = None

    # A copied or unpickled model gets a fresh, closed gate (install_fast_path then binds its
    # fused modules to the copy's own gate): an open gate must never leak into a copy.
    def __deepcopy__(self, memo) -> "Gate":
        return Gate()

    def __reduce__(self):
        return (Gate, ())

    @property
    def is_open(self) -> bool:
        return getattr(self._local, "is_open", False)

    @property
    def stats(self) -> RunStats:
        stats = getattr(self._local, "stats", None)
        if stats is None:
            stats = self._local.stats = RunStats()
        return stats

    @contextlib.contextmanager
    def opened(self, is_open: bool = True) -> Iterator[RunStats]:
        """Open (or explicitly close) the gate for one decode; yields that decode's stats."""
        local = self._local
        previous = (getattr(local, "is_open", False), getattr(local, "stats", None))
        local.is_open, local.stats = bool(is_open), RunStats()
        try:
            yield local.stats
        finally:
            local.is_open, local.stats = previous

    def allows_fast_path(self) -> bool:
        """True when a fused module may take its fast path now.

        Never while torch.compile traces: a trace must see the stock graph (and no eager
        Triton launch), so a compiled decoder is exact whatever the gate says.
        """
        return self.is_open and not torch.compiler.is_compiling()


_GATES: "weakref.WeakKeyDictionary[torch.nn.Module, Gate]" = weakref.WeakKeyDictionary()
_GATES_LOCK = threading.Lock()


def gate_for(model: torch.nn.Module) -> Gate:
    """The one gate of ``model`` (created on first use)."""
    with _GATES_LOCK:
        gate = _GATES.get(model)
        if gate is None:
            gate = _GATES[model] = Gate()
        return gate


def existing_gate(model: torch.nn.Module) -> Gate | None:
    return _GATES.get(model)


def decoder_models(vae: object) -> list[torch.nn.Module]:
    """The model(s) whose decoder the fast path installs into, behind a VAE wrapper.

    ``comfy.sd.VAE`` keeps its network in ``first_stage_model``; a diffusers autoencoder (or any
    ``nn.Module``) is the model itself. Anything else has none.
    """
    inner = getattr(vae, "first_stage_model", None)
    if isinstance(inner, torch.nn.Module):
        return [inner]
    if isinstance(vae, torch.nn.Module):
        return [vae]
    return []


@contextlib.contextmanager
def gates_opened(vae: object, is_open: bool) -> Iterator[list[RunStats]]:
    """Open (or close) the gates of every decoder model behind ``vae`` for one decode."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(gate_for(m).opened(is_open)) for m in decoder_models(vae)]
