"""The hand-over between a video decode loop and the pixel output: frames as soon as they are final.

The pixel output (``pixels.decode``) opens ``frames_to(sink)``; a family's decode loop that knows
when a chunk of frames is final (the Wan loops) reads ``frames_sink()`` and, once it knows
the whole output's shape, asks ``sink.begin(shape, dtype, device)``. If the sink takes the
frames, the loop hands over every chunk in order (``sink.take(chunk, start)``), keeps none of
them, and returns ``sink.result()``: the decode never holds its whole output on the GPU, so its
peak memory does not grow with the number of frames.

A decoder that writes its frames into an output buffer the caller gives it (ComfyUI 0.33's LTX
``VideoVAE``) cannot hand chunks over, but its family knows when each write comes: the module
that makes the frames (LTX's head conv) tells a ``BufferSink`` how many frames the decoder will
write next (``sink.next_write(frames)``), after every earlier write was queued, so the sink can
take the frames written so far while the decoder goes on.

Kept apart from both sides so neither imports the other.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Protocol, runtime_checkable

import torch


class FrameSink(Protocol):
    def begin(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the sink takes every frame of an output of ``shape`` (B, C, T, H, W)."""

    def take(self, chunk: torch.Tensor, start: int) -> None:
        """Frames ``start:start + chunk.shape[2]`` of the output, final; called in order."""

    def result(self) -> torch.Tensor:
        """What the loop returns once every frame was taken (a stand-in of the output's shape)."""


@runtime_checkable
class BufferSink(Protocol):
    def next_write(self, frames: int) -> None:
        """The decoder writes ``frames`` more frames into its output buffer next; every earlier
        write is already queued on the current stream."""


class FramesLost(RuntimeError):
    """A loop that handed its frames to a sink met a chunk the sink cannot place; the frames
    taken before it are no longer in the decode, so the caller decodes again its own way."""


_SINK: contextvars.ContextVar[FrameSink | None] = contextvars.ContextVar(
    "fast_vae_decode_frame_sink", default=None)


@contextlib.contextmanager
def frames_to(sink: FrameSink) -> Iterator[None]:
    """Within this block a video decode loop offers its frames to ``sink`` (the node streams
    them to host memory while the next chunk decodes). Only an offer: the caller checks what
    came back."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def frames_sink() -> FrameSink | None:
    """The sink of the innermost ``frames_to`` block on this context, if any."""
    return _SINK.get()
