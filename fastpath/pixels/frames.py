"""The hand-over between a video decode loop and the pixel output: frames as soon as they are final.

The pixel output (``pixels.decode``) asks for frames with ``frames_to``; a family's decode loop
that knows when a chunk of frames is final (the Wan 2.1 loop) reads ``frames_ready_hook()`` and
calls it. Kept apart from both so neither imports the other.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

FramesReady = Callable[[torch.Tensor, int, int], None]

# Who wants each chunk of final frames as soon as it is in the output (``frames_to``).
_FRAMES_READY: contextvars.ContextVar[FramesReady | None] = contextvars.ContextVar(
    "fast_vae_decode_frames_ready", default=None)


@contextlib.contextmanager
def frames_to(frames_ready: FramesReady) -> Iterator[None]:
    """Within this block, a ComfyUI Wan 2.1 decode loop calls ``frames_ready(out, start, stop)``
    after frames ``start:stop`` of its output ``out`` are final (the node streams them to host
    memory while the next chunk decodes). Only a hint: the caller checks what came back."""
    token = _FRAMES_READY.set(frames_ready)
    try:
        yield
    finally:
        _FRAMES_READY.reset(token)


def frames_ready_hook() -> FramesReady | None:
    """The ``frames_ready`` of the innermost ``frames_to`` block on this context, if any."""
    return _FRAMES_READY.get()
