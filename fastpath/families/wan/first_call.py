"""The first decoder call of a Wan decode loop, replayed from a CUDA graph (``cuda_graph``).

A decode loop calls the decoder once per latent frame (or pair), the first call with an empty
frame cache. That call decodes a single frame: its ~200 kernels give an H200 less work than
Python needs to issue them (Wan 2.1 480x832: ~21 ms of the GPU waiting, almost all of a
decode's idle time), and for a single-frame latent (Qwen-Image, a Wan still) it is the whole
decode. Starting from an empty cache, it depends only on its input, the weights and the
settings, so once a shape has been decoded eagerly it is captured, and later decodes replay it.

The loop's later calls build folds of their own (the steady-state chunks' kernels), so the
loop ``settle``s once it has finished: the next decode may capture.

The call runs on a cache list of its own (fresh, all empty); what it leaves there is copied into
the loop's list afterwards, so a capture that fails or is thrown away leaves the loop's cache as
an eager call would find it. The cache entries handed out are copies (``cuda_graph``): the loop
holds them past the replay.

Off by default (``settings.cuda_graphs``): the graph's pool, kept between decodes, is larger
than the eager decode's peak, and it put every measured Wan and Qwen case over stock's peak
for a few percent of speed (docs/benchmark/268e0d1).
"""
from __future__ import annotations

import torch

from ...cuda_graph import graphed_call, settings_key, settle
from ...gate import existing_gate
from .settings import settings


def first_decoder_call(model: torch.nn.Module, decoder: torch.nn.Module, chunk: torch.Tensor,
                       feat_cache: list | None, **kwargs):
    """``decoder(chunk, feat_cache=feat_cache, feat_idx=[0], **kwargs)`` for a loop's first call
    (``feat_cache`` empty, or None where the loop runs without one)."""
    gate = existing_gate(model)
    if (gate is None or not settings.cuda_graphs or not gate.is_open
            or (feat_cache is not None and any(entry is not None for entry in feat_cache))):
        return decoder(chunk, feat_cache=feat_cache, feat_idx=[0], **kwargs)
    slots = None if feat_cache is None else len(feat_cache)

    def run(x: torch.Tensor):
        cache = None if slots is None else [None] * slots
        return decoder(x, feat_cache=cache, feat_idx=[0], **kwargs), cache

    key = (slots, tuple(sorted(kwargs.items())), settings_key(settings))
    out, cache = graphed_call(decoder, chunk, run, key, gate=gate)
    if feat_cache is not None:
        feat_cache[:] = cache
    return out


def settle_first_call(model: torch.nn.Module, decoder: torch.nn.Module) -> None:
    """After a decode loop finished: its first call counts as seen as the folds are now."""
    if settings.cuda_graphs and existing_gate(model) is not None:
        settle(decoder)
