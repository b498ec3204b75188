"""Progress of one decode, reported per finished chunk of work, and the place to stop it.

A caller (the node layer: ComfyUI's progress bar and its Cancel button) opens
``progress_to(report)``; a decode loop that knows its chunks (a family's frame loop, the pixel
output's batch slices) calls ``advance(done, total)`` after each one. ``report`` may raise to
stop the decode between chunks (ComfyUI's interrupt): that happens before the next chunk
starts, so no module is left half-way through a call, and every per-call state the pack keeps
(the gate, fetched weights) is restored by its own ``finally``. Without a ``progress_to`` block
``advance`` does nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

Report = Callable[[int, int], None]  # (chunks done, chunks in all)

_REPORT: contextvars.ContextVar[Report | None] = contextvars.ContextVar(
    "fast_vae_decode_progress", default=None)


@contextlib.contextmanager
def progress_to(report: Report) -> Iterator[None]:
    """Reports of the decode run inside go to ``report``; one that ends without reporting its
    end (a path without chunks of its own, e.g. ComfyUI's ``VAE.decode``) reports ``(1, 1)``,
    so the bar always ends full."""
    ended = False

    def tracked(done: int, total: int) -> None:
        nonlocal ended
        ended = done >= total
        report(done, total)

    token = _REPORT.set(tracked)
    try:
        yield
    finally:
        _REPORT.reset(token)
    if not ended:
        report(1, 1)


def advance(done: int, total: int) -> None:
    """``done`` of ``total`` chunks are finished (``done == total`` at the end)."""
    report = _REPORT.get()
    if report is not None:
        report(done, total)


@contextlib.contextmanager
def nested(offset: int, scale: int, total: int) -> Iterator[None]:
    """Inside one of ``total`` outer chunks (the ``offset``-th, each ``scale`` units wide):
    an inner loop's ``advance(d, t)`` reports ``offset * scale + d * scale // t`` of
    ``total * scale``, so one bar covers e.g. a batch of videos."""
    outer = _REPORT.get()
    if outer is None:
        yield
        return

    def inner(done: int, inner_total: int) -> None:
        outer(offset * scale + (done * scale) // max(1, inner_total), total * scale)

    token = _REPORT.set(inner)
    try:
        yield
    finally:
        _REPORT.reset(token)
