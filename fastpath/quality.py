"""One decode at a chosen quality: install if needed, open the gate only for ``high``.

``lossless`` explicitly closes the gate (so a lossless decode nested inside an open one is
still stock), and ``high`` falls back to the stock path, with one reason, whenever the fast
path cannot run. Nothing global stays changed after ``decode_at_quality`` returns or raises.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ..kernels.backend import triton_unavailable_reason
from .gate import RunStats, decoder_models, gates_opened
from .install import install_fast_path
from .log import log_once
from .reasons import most_common

QUALITIES = ("high", "lossless")
DEFAULT_QUALITY = "high"

T = TypeVar("T")


@dataclass
class DecodeOutcome:
    """Which path a decode took, for the node's UI text, the web extension and the log."""

    quality: str
    path: str = "lossless"  # "high" | "lossless" | "fallback"
    fused_modules: int = 0
    reason: str | None = None
    ms: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def text(self) -> str:
        if self.path == "high":
            text = f"high: {self.fused_modules} fused modules"
            if self.fallbacks:
                text += f" ({sum(self.fallbacks.values())} stock calls: {most_common(self.fallbacks)})"
            return text
        if self.path == "fallback":
            return f"fallback: {self.reason}"
        return "lossless"

    def as_ui(self) -> dict:
        return {"path": self.path, "quality": self.quality, "fused": self.fused_modules,
                "ms": round(self.ms, 1), "reason": self.reason or "", "text": self.text()}


def check_quality(quality: str) -> str:
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {', '.join(QUALITIES)}; got {quality!r}")
    return quality


def fast_path_unavailable(vae: object) -> tuple[str | None, int]:
    """(reason the fast path cannot run for ``vae``, number of fused modules installed)."""
    models = decoder_models(vae)
    if not models:
        return f"unsupported VAE ({type(vae).__name__})", 0
    # Install even where Triton cannot run: it is free (a class swap), and the same installed
    # modules then serve a later process state, while the closed gate keeps them exact.
    reports = [install_fast_path(m) for m in models]
    fused = sum(r.fused for r in reports)
    if fused == 0:
        return next((r.reason for r in reports if r.reason), "nothing installed"), 0
    reason = triton_unavailable_reason()
    return (reason, fused) if reason is not None else (None, fused)


def decode_at_quality(vae: object, quality: str, decode: Callable[[], T]) -> tuple[T, DecodeOutcome]:
    """Run ``decode()`` with the gates of ``vae`` open for ``high`` and closed for ``lossless``."""
    outcome = DecodeOutcome(quality=check_quality(quality))
    want_fast = quality == "high"
    if want_fast:
        outcome.reason, outcome.fused_modules = fast_path_unavailable(vae)
        want_fast = outcome.reason is None
    else:
        # Installing is also what gives lossless its exact shortcuts (the preallocated Wan
        # decode loop, one-copy causal convs, the one-pass RMS norm); the gate stays closed.
        for model in decoder_models(vae):
            install_fast_path(model)
    start = time.perf_counter()
    with gates_opened(vae, want_fast) as stats:
        result = decode()
    broken = sorted({name for s in stats for name in s.kernel_errors})
    if broken:
        # The modules that raised returned their stock output inside an otherwise fused
        # decode; the caller asked for a result, and the only exact one is a stock decode.
        # They are disabled now, so this happens once per broken module per session.
        del result
        with gates_opened(vae, False):
            result = decode()
    outcome.ms = (time.perf_counter() - start) * 1e3
    if quality == "high":
        _classify(outcome, stats)
        if broken:
            outcome.path = "fallback"
            outcome.reason = (f"kernel error in {', '.join(broken)} (disabled for this session); "
                              "decoded again on the stock path")
        if outcome.path == "fallback":
            log_once(f"fallback:{outcome.reason}", f"high quality took the stock path: {outcome.reason}")
    return result, outcome


def _classify(outcome: DecodeOutcome, stats: list[RunStats]) -> None:
    fused_calls = sum(s.fused_calls for s in stats)
    for s in stats:
        for reason, n in s.fallbacks.items():
            outcome.fallbacks[reason] = outcome.fallbacks.get(reason, 0) + n
    if outcome.reason is None and fused_calls == 0:
        outcome.reason = most_common(outcome.fallbacks) if outcome.fallbacks else "no fused module ran"
    outcome.path = "fallback" if outcome.reason is not None else "high"
