"""A causal 3x3x3 conv of T output frames as one 2-D conv over a channel-stacked input.

Output frame t of a 3x3x3 conv (its time padding already in front of the frames) reads input
frames t, t+1 and t+2. In the stacked layout a buffer of shape (T, 3C, H, W), channels-last,
holds for frame t the 3C channels ``[x_t | x_t+1 | x_t+2]``; the weight is the three temporal
taps side by side, (Cout, 3C, 3, 3). Then the conv is ``conv2d(buffer, weight)`` with the
spatial padding done by the conv: one GEMM of K = 27 C, accumulated in fp32 in one sum (the
per-tap route rounds its partial sums to the activation dtype before adding them).

Why (H200, torch 2.11, cuDNN 9.19, bf16, median of 20, docs/benchmark/b28b6be): 384 ->
384 at 4 x 120 x 208, cuDNN's conv3d 1.327 ms, stacked 1.080; 96 -> 96 at 4 x 480 x 832, conv3d
2.856, three 2-D taps and their adds 2.174, stacked 1.755 (453 TFLOP/s). Which convs take it is
the caller's measured table (``fastpath.families.wan.ops.STACKED_TAPS_MIN_PIXELS``).
The price: each input frame lands in up to three places (slot k of output frame j - k), three
times the bytes of an assembled input. The producer of the frames (the RMS norm before the
conv) writes all of them from the same registers (``rms_norm_silu(stacked=...)``); the few
frames that come from elsewhere (a previous chunk's cache, causal zeros) are copied in by
``fill_stacked_``, which is also the plain-torch twin of that store.

Frame indices: ``first`` is where a run of frames starts in the conv's whole (padded) input
sequence, so frame i of the run is sequence frame ``first + i``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TAPS = 3  # the temporal kernel this layout is for


def slot_ranges(first: int, count: int, frames_out: int, slots: int = TAPS):
    """For a run of ``count`` frames starting at sequence frame ``first``: per slot k, the
    ``(k, lo, hi)`` run-frame range ``[lo, hi)`` that slot k of output frames
    ``first + lo - k ...`` receives (output frames outside ``[0, frames_out)`` are dropped)."""
    out = []
    for k in range(slots):
        lo = max(0, k - first)
        hi = min(count, frames_out + k - first)
        if hi > lo:
            out.append((k, lo, hi))
    return out


def new_stacked_input(frames_out: int, channels: int, height: int, width: int,
                      dtype: torch.dtype, device) -> torch.Tensor:
    """An empty (frames_out, 3 * channels, H, W) channels-last buffer."""
    return torch.empty((frames_out, TAPS * channels, height, width), dtype=dtype, device=device,
                       memory_format=torch.channels_last)


def _slot(buffer: torch.Tensor, k: int, channels: int, t0: int, t1: int) -> torch.Tensor:
    """Slot k of output frames [t0, t1) as a (1, C, t1 - t0, H, W) view (channels-last-3d
    strides up to the channel gap)."""
    return buffer[t0:t1, k * channels:(k + 1) * channels].permute(1, 0, 2, 3).unsqueeze(0)


def fill_stacked_(buffer: torch.Tensor, frames: torch.Tensor | None, first: int,
                  count: int | None = None) -> torch.Tensor:
    """Write the (1, C, n, H, W) ``frames`` (sequence frames ``first ...``) into every slot they
    feed; ``frames=None``: ``count`` zero frames. Returns ``buffer``."""
    channels = buffer.shape[1] // TAPS
    n = frames.shape[2] if frames is not None else count
    for k, lo, hi in slot_ranges(first, n, buffer.shape[0]):
        dst = _slot(buffer, k, channels, first + lo - k, first + hi - k)
        if frames is None:
            dst.zero_()
        else:
            dst.copy_(frames[:, :, lo:hi])
    return buffer


def stacked_taps_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (Cout, C, 3, KH, KW) conv weight as the stacked conv's (Cout, 3C, KH, KW), channels-last."""
    return torch.cat([weight[:, :, k] for k in range(TAPS)], dim=1).contiguous(
        memory_format=torch.channels_last)


def stacked_taps_conv(buffer: torch.Tensor, weight: torch.Tensor, pad_h: int,
                      pad_w: int) -> torch.Tensor:
    """The conv (no bias) of the stacked ``buffer``: (1, Cout, T, H, W), a channels-last-3d view."""
    out = F.conv2d(buffer, weight, None, padding=(pad_h, pad_w))
    return out.unsqueeze(0).permute(0, 2, 1, 3, 4)


def stacked_taps_reference(x: torch.Tensor, weight: torch.Tensor, pad_h: int,
                           pad_w: int) -> torch.Tensor:
    """The test oracle: ``conv3d`` of the assembled (1, C, T + 2, H, W) input, no bias."""
    return F.conv3d(x, weight, None, 1, (0, pad_h, pad_w))
