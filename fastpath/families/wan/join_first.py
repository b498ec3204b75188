"""A decode's first latent frame decoded in the same decoder call as the next chunk (the setting
``join_first_chunk``).

Why: the loop's first decoder call decodes one frame. Its kernels give the GPU less work than
Python needs to issue them: on an H200 the GPU waited for the host through all of that call and
the start of the next, ~15-17 ms of every Wan 2.1 480p decode (docs/benchmark/7c40816, section
4). Joined, the first frame's launches are the next chunk's, which carry that chunk's frames
too; one decoder call's host time fewer, no memory kept between decodes (the first-call CUDA
graph, ``first_call``, removed the same wait at the cost of its pool).

Why the sums are the stock ones: every causal conv, norm and attention of a Wan decoder sees
the frames in order behind zero frames either way (the frames a joined call has in front of a
frame are what the stock cache would hold). Wan 2.2's duplicating shortcut (``DupUp3D``) works
frame by frame, and its first-chunk rule drops the first output frames of the first latent
frame, which in a joined call are still the first ones. The exception is a temporal upsample
(``Resample``, ``upsample3d``): the first chunk's frame skips its time conv (the cache marker
"Rep"), and the next chunk's time conv starts from zeros, not from that frame. So within a
joined call a temporal upsample runs itself twice (``split_first_frame``): on the first frame
and on the rest, each meeting the cache state the stock loop would give it, whichever path
(fused or stock) each half then takes.

ComfyUI 0.33+'s decoder then cuts the frames after a temporal upsample into pairs (its
``run_up``), and its blocks cache the last two frames of their own input. Its stock cut of a
joined call's 1 + 2k frames would pair the first frame with the next one and leave a one-frame
piece at the end, whose one-frame cache the next call's blocks would then read. So there
``JoinedRunUp`` cuts them itself (``settings.join_pieces``): after every temporal upsample but
the last, the first frame rides in front of the first pair (a three-frame piece: its blocks'
launches carry two more frames, so the GPU is not left waiting for the host); after the last
one it is a piece of its own, followed by the pairs, which are stock's pieces at the sizes where
a decode's peak memory is. (Riding in front of the first pair down to full size put Wan 2.1
x33's peak over stock's on 0.33: docs/benchmark/s35.)

Taken with the gate open only (lossless keeps the stock calls: other batch shapes may pick
other cuDNN kernels), and by default only in 0.33+'s chunked loop: in a per-frame loop the join
measured no gain (``settings.join_per_frame``).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator

import torch

from ....kernels.backend import triton_unavailable_reason
from ...comfyui.wan_code import method_code
from ...gate import existing_gate
from .settings import settings

_JOINING: ContextVar[bool] = ContextVar("fvd_wan_joining", default=False)

PAIR = 2  # frames per piece of ComfyUI 0.33+'s run_up after a temporal upsample


def joining() -> bool:
    """Whether the decoder call running now is a joined first call."""
    return _JOINING.get()


@contextlib.contextmanager
def joined() -> Iterator[None]:
    token = _JOINING.set(True)
    try:
        yield
    finally:
        _JOINING.reset(token)


def is_temporal_upsample(module: object) -> bool:
    return getattr(module, "mode", None) == "upsample3d" and hasattr(module, "time_conv")


def first_in_join(x: object, feat_cache: object, feat_idx: object) -> bool:
    """Whether a temporal upsample meets the decode's first frame with others behind it: a
    joined call, its cache slot still empty, more than one frame."""
    if not joining() or not isinstance(feat_cache, list) or not isinstance(feat_idx, list):
        return False
    idx = feat_idx[0] if feat_idx else None
    return (isinstance(idx, int) and 0 <= idx < len(feat_cache) and feat_cache[idx] is None
            and isinstance(x, torch.Tensor) and x.dim() == 5 and x.shape[2] > 1)


def split_first_frame(call: Callable, x: torch.Tensor, index: list, /, *args, **kwargs):
    """``call`` (a temporal upsample's forward, its cache arguments in ``args``/``kwargs``;
    ``index`` the ``feat_idx`` among them) on the first frame as a first chunk, then on the
    other frames as the next chunk; their outputs joined in time. The first call marks the
    cache slot and advances ``index``; the second starts from the same slot, as the stock
    loop's next call would."""
    slot = index[0]
    head = call(x[:, :, :1], *args, **kwargs)
    index[0] = slot
    tail = call(x[:, :, 1:], *args, **kwargs)
    # In the tail's layout: torch counts a one-frame head as both contiguous and
    # channels-last-3d, and its cat then wrote NCTHW, so the blocks after the upsample read a
    # strided input (and launched kernel variants the warm-up had not compiled).
    shape = (*tail.shape[:2], head.shape[2] + tail.shape[2], *tail.shape[3:])
    layout = torch.channels_last_3d if tail.is_contiguous(memory_format=torch.channels_last_3d) \
        else torch.contiguous_format
    out = torch.empty(shape, dtype=tail.dtype, device=tail.device, memory_format=layout)
    return torch.cat([head, tail], 2, out=out)


def upsample_cache_args(args: tuple, kwargs: dict) -> tuple[object, object]:
    """``(feat_cache, feat_idx)`` as a Resample's caller passed them (positional or keyword)."""
    feat_cache = args[0] if args else kwargs.get("feat_cache")
    feat_idx = args[1] if len(args) > 1 else kwargs.get("feat_idx")
    return feat_cache, feat_idx


class JoinedRunUp:
    """ComfyUI 0.33+'s ``Decoder3d`` with a joined first call's pieces: after a temporal
    upsample that met the first frame (``first_in_join``) the pieces are that frame in front of
    the first pair or alone (``_first_frame_alone``), then pairs; every other step is the stock
    ``run_up``. Installed only on the ``run_up`` this pack knows (``wan_code``)."""

    def run_up(self, layer_idx, x_ref, feat_cache, feat_idx, out_chunks):
        layer = self.upsamples[layer_idx] if layer_idx < len(self.upsamples) else None
        if not (is_temporal_upsample(layer) and first_in_join(x_ref[0], feat_cache, feat_idx)):
            return super().run_up(layer_idx, x_ref, feat_cache, feat_idx, out_chunks)
        x = x_ref[0]
        x_ref[0] = None
        x = layer(x, feat_cache, feat_idx)  # 1 + 2k frames: the first one not doubled in time
        starts = [0] + list(range(1 if self._first_frame_alone(layer_idx) else 1 + PAIR,
                                  x.shape[2], PAIR))
        stops = starts[1:] + [x.shape[2]]
        for start, stop in zip(starts, stops, strict=True):
            super().run_up(layer_idx + 1, [x[:, :, start:stop]], feat_cache, feat_idx.copy(),
                           out_chunks)

    def _first_frame_alone(self, layer_idx: int) -> bool:
        """Whether the pieces after the temporal upsample at ``layer_idx`` start with the first
        frame alone (``settings.join_pieces``)."""
        if settings.join_pieces == "ride_below_last":
            return not any(is_temporal_upsample(m) for m in self.upsamples[layer_idx + 1:])
        return settings.join_pieces != "ride"


def run_up_reason(decoder: torch.nn.Module) -> str | None:
    """Why ``JoinedRunUp`` may not go onto ``decoder`` (ComfyUI 0.33+'s ``Decoder3d``)."""
    code = method_code(decoder, "run_up")
    return code if isinstance(code, str) else None


def join_reason(model: torch.nn.Module, decoder: torch.nn.Module, pieces: bool,
                x: torch.Tensor) -> str | None:
    """Why this decode's first call over ``x`` (the decoder's input) is not joined (None: it
    is); ``pieces``: the decoder cuts frames into pairs (ComfyUI 0.33+), which needs
    ``JoinedRunUp``."""
    if not settings.join_first_chunk:
        return "off"
    if not pieces and not settings.join_per_frame:
        return "a per-frame loop (join_per_frame off)"
    gate = existing_gate(model)
    if gate is None or not gate.allows_fast_path():
        return "gate closed"
    # Where no kernel can run every module falls back, and the decode must be stock's own calls
    # (a joined call's other batch shapes round differently, e.g. in a CPU conv).
    reason = triton_unavailable_reason(x)
    if reason is not None:
        return reason
    if pieces and not isinstance(decoder, JoinedRunUp):
        return "decoder without the joined pieces"
    # Only the fused class splits a temporal upsample (``splits_first_frame``); a stock one
    # would skip every frame's time conv in a first call of several frames.
    if not all(getattr(m, "_fvd_splits_first_frame", False)
               for m in decoder.modules() if is_temporal_upsample(m)):
        return "a temporal upsample is not fused"
    return None
