"""A padded grid's border and its front frames in one pass (``padded_grid_fill``).

``padded_grid_conv`` reads its input from a grid with one zero pixel around every frame
(``padded_grid_conv.empty_padded``). A causal conv's grid starts with zero frames and the
frames cached from the last chunk (the front); the norm before the conv writes the new frames
into the rest of the interior. With torch that took five launches per conv: four fills of the
border (one of them C elements per pixel row) and a copy of the cached frames into the
interior, which torch runs as its generic strided copy, element by element. On an H200 those
copies took 37 ms of a routed Wan 2.1 x33 decode on ComfyUI 0.8 (542 launches), about a third
of copy speed for the bytes they move (s48 profile, ``docs/benchmark/s48/h200``).

Here each program owns a block of one padded pixel row (W + 2 pixels of C channels, contiguous
in the grid): in a front frame it writes the whole block (zeros, or a cached row between two
zero pixels), and in a new frame only the border pixels it holds, never the interior the
producer writes. Where the cached frames' pixel rows are dense (x stride C), a block that lies
inside the row reads them as one contiguous run.

Offsets are int64: a grid of 96 channels at 1280x720 passes 2^31 elements at 25 frames.
Its plain-torch twin and test oracle is ``padded_grid_fill_reference``.
"""
from __future__ import annotations

import torch

from .accepts import FLOAT_DTYPES
from .backend import launch, on_device, tl, triton, triton_unavailable_reason
from .padded_grid_conv import zero_border

BLOCK = 2048  # elements of a pixel row per program: 16 per thread at 4 warps
NUM_WARPS = 4


def grid_layout_reason(padded: torch.Tensor) -> str | None:
    """None where ``padded`` is a whole grid as ``empty_padded`` lays it out: (1, C, T, H + 2,
    W + 2), channels innermost, frames and pixel rows dense."""
    if padded.dim() != 5 or padded.shape[0] != 1:
        return f"{tuple(padded.shape)} is not a (1, C, T, H + 2, W + 2) grid"
    _, c, _, h2, w2 = padded.shape
    if tuple(padded.stride()[1:]) != (1, h2 * w2 * c, w2 * c, c):
        return "the grid is not dense channels-last-3d"
    if h2 < 3 or w2 < 3:
        return "the grid has no interior"
    return None


def padded_grid_fill_unsupported(padded: torch.Tensor, front: torch.Tensor | None,
                                 zeros: int) -> str | None:
    """Why ``padded_grid_fill`` cannot take these (short, for the log); None if it can."""
    reason = triton_unavailable_reason(padded) or grid_layout_reason(padded)
    if reason is not None:
        return reason
    if padded.dtype not in FLOAT_DTYPES:
        return f"{padded.dtype} grid"
    _, c, t, h2, w2 = padded.shape
    n = 0
    if front is not None:
        if (front.dim() != 5 or front.shape[0] != 1 or front.shape[1] != c
                or tuple(front.shape[3:]) != (h2 - 2, w2 - 2)):
            return f"cached frames {tuple(front.shape)} do not fit the grid {tuple(padded.shape)}"
        if front.dtype != padded.dtype or front.device != padded.device:
            return "cached frames differ from the grid in dtype or device"
        if c > 1 and front.stride(1) != 1:
            return "cached frames are not channels-last"
        n = front.shape[2]
    if zeros < 0 or zeros + n > t:
        return f"{zeros} zero and {n} cached frames in a grid of {t}"
    if torch.is_grad_enabled() and padded.requires_grad:
        return "autograd (the kernel has no backward)"
    return None


def padded_grid_fill_reference(padded: torch.Tensor, front: torch.Tensor | None,
                               zeros: int) -> None:
    """In place: zero ``padded``'s border in every frame and its first ``zeros`` frames, and
    copy ``front`` into the interior of the frames after those; the interior of the frames
    after ``front`` is left as it is."""
    n = 0 if front is None else front.shape[2]
    padded[:, :, :zeros].zero_()
    zero_border(padded)
    if n:
        padded[:, :, zeros:zeros + n, 1:-1, 1:-1].copy_(front)


def padded_grid_fill(padded: torch.Tensor, front: torch.Tensor | None, zeros: int) -> bool:
    """``padded_grid_fill_reference`` in one launch; False (nothing written) where unsupported
    (``padded_grid_fill_unsupported`` says why: the caller fills with torch)."""
    if padded_grid_fill_unsupported(padded, front, zeros) is not None:
        return False
    _, c, t, h2, w2 = padded.shape
    row = w2 * c
    n = 0 if front is None else front.shape[2]
    src = padded if front is None else front
    s_t, s_y, s_x = (0, 0, c) if front is None else (front.stride(2), front.stride(3),
                                                     front.stride(4))
    grid = (t * h2, -(-row // BLOCK))
    with on_device(padded.device):
        launch(_padded_grid_fill_kernel, grid, padded, src, h2, row, s_t, s_y, s_x,
               zeros, zeros + n, C=c, DENSE=int(s_x == c), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return True


if triton is not None:

    @triton.jit(do_not_specialize=["H2", "zeros", "front"])
    def _padded_grid_fill_kernel(
        grid_ptr, src_ptr, H2, ROW, s_t, s_y, s_x, zeros, front,
        C: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)  # a padded pixel row, over all frames
        blk = tl.program_id(1)
        t = r // H2
        y2 = r - t * H2
        start = blk * BLOCK
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < ROW
        dst = grid_ptr + r.to(tl.int64) * ROW + offs
        zero = tl.zeros((BLOCK,), dtype=grid_ptr.dtype.element_ty)
        edge_row = (y2 == 0) | (y2 == H2 - 1)
        if t < front:
            if (t < zeros) | edge_row:
                tl.store(dst, zero, mask=in_row)
            else:
                base = (t - zeros).to(tl.int64) * s_t + (y2 - 1).to(tl.int64) * s_y
                if DENSE:
                    # The cached row is W * C contiguous elements: offset by one pixel.
                    src = src_ptr + base + (offs - C)
                    if (start >= C) & (start + BLOCK <= ROW - C):
                        tl.store(dst, tl.load(src))
                    else:
                        inside = (offs >= C) & (offs < ROW - C)
                        tl.store(dst, tl.load(src, mask=inside, other=0.0), mask=in_row)
                else:
                    x2 = offs // C
                    inside = (x2 >= 1) & (offs < ROW - C)
                    src = src_ptr + base + (x2 - 1).to(tl.int64) * s_x + (offs - x2 * C)
                    tl.store(dst, tl.load(src, mask=inside, other=0.0), mask=in_row)
        elif edge_row:
            tl.store(dst, zero, mask=in_row)
        elif (start < C) | (start + BLOCK > ROW - C):
            # Only the border pixels of a new frame's row: its interior is the producer's.
            tl.store(dst, zero, mask=in_row & ((offs < C) | (offs >= ROW - C)))


__all__ = [
    "padded_grid_fill",
    "padded_grid_fill_reference",
    "padded_grid_fill_unsupported",
]
