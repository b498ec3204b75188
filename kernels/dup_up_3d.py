"""Wan 2.2's duplicating up-shortcut (``DupUp3D``) written straight into channels-last-3d.

The shortcut of each upsampling block in the Wan 2.2 decoder spreads channels into space and
time without arithmetic: with ``F = ft * fs * fs`` (time and space factors) and
``r = C_out * F / C_in`` (how often each input channel repeats), output element

    out[b, co, t*ft + i, h*fs + j, w*fs + k] = x[b, (co*F + (i*fs + j)*fs + k) // r, t, h, w]

and ``drop`` leading frames are left out (``ft - 1`` on the first chunk). Stock builds it with
a repeat, a permute to an 8-D view and a copy; on channels-last-3d activations that copy and
the add after it run torch's strided elementwise path (Wan 2.2 704x1280x33 on an H200: 159 ms
of a 913 ms decode in strided copies and adds, about 127 ms of which this kernel removed).
Here one pass gathers each output pixel's channels from one input pixel and writes the output
in channels-last-3d, so the block's add is a dense one.

Layout: ``x`` any strides (offsets from its strides); the output is a new channels-last-3d
tensor. Offsets are int64 (full-resolution Wan 2.2 outputs pass 2^31 elements per chunk).
Values are copied, never rounded: the result equals the stock shortcut exactly.
"""
from __future__ import annotations

import torch

from .accepts import Accepts, autograd_reason, pow2
from .backend import launch, on_device, tl, triton

TILE_ELEMENTS = 4096
NUM_WARPS = 4
MAX_BLOCK_C = 4096

DUP_UP_3D = Accepts(min_rank=5, max_rank=5, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                    max_block_c=MAX_BLOCK_C)


def dup_up_3d_shape(x_shape, out_channels: int, factor_t: int, factor_s: int,
                    drop: int = 0) -> tuple[int, ...]:
    b, _, t, h, w = x_shape
    return (b, out_channels, t * factor_t - drop, h * factor_s, w * factor_s)


def dup_up_3d_reference(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int,
                        drop: int = 0) -> torch.Tensor:
    """The formula above with torch indexing (contiguous result): the kernel's test oracle."""
    b, c_in, t, h, w = x.shape
    factor = factor_t * factor_s * factor_s
    repeats = out_channels * factor // c_in
    # Output channel co, phase (i, j, k) -> source channel.
    phase = torch.arange(factor, device=x.device)
    src = (torch.arange(out_channels, device=x.device)[:, None] * factor + phase) // repeats
    g = x.index_select(1, src.reshape(-1))  # (b, co*F, t, h, w), phase fastest
    g = g.reshape(b, out_channels, factor_t, factor_s, factor_s, t, h, w)
    g = g.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, out_channels, t * factor_t, h * factor_s,
                                                  w * factor_s)
    return g[:, :, drop:].contiguous()


def dup_up_3d_unsupported(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int,
                          drop: int = 0) -> str | None:
    """Why ``dup_up_3d`` cannot take these arguments (short, for the log); None if it can."""
    reason = DUP_UP_3D.tensor_reason(x) or DUP_UP_3D.channels_reason(out_channels)
    if reason is not None:
        return reason
    if min(factor_t, factor_s, out_channels) < 1:
        return "factors and channels must be positive"
    factor = factor_t * factor_s * factor_s
    if (out_channels * factor) % x.shape[1]:
        return f"{out_channels} x {factor} output slots do not repeat {x.shape[1]} channels evenly"
    if not 0 <= drop < x.shape[2] * factor_t:
        return f"dropping {drop} of {x.shape[2] * factor_t} frames"
    return autograd_reason(x)


def dup_up_3d(x: torch.Tensor, out_channels: int, factor_t: int, factor_s: int,
              drop: int = 0) -> torch.Tensor | None:
    """The shortcut of ``x`` as a new channels-last-3d tensor, or None when unsupported
    (``dup_up_3d_unsupported`` says why; the caller runs the stock module)."""
    if dup_up_3d_unsupported(x, out_channels, factor_t, factor_s, drop) is not None:
        return None
    shape = dup_up_3d_shape(x.shape, out_channels, factor_t, factor_s, drop)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last_3d)
    factor = factor_t * factor_s * factor_s
    block_c = pow2(out_channels)
    block_p = max(1, TILE_ELEMENTS // block_c)
    rows = out.numel() // out_channels
    grid = (-(-rows // block_p),)
    with on_device(x.device):
        launch(_dup_up_3d_kernel, grid,
               x, out, rows, shape[2], shape[3], shape[4],
               x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4), drop,
               C_OUT=out_channels, FT=factor_t, FS=factor_s,
               REPEATS=out_channels * factor // x.shape[1],
               BLOCK_P=block_p, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["ROWS", "T_OUT", "H_OUT", "W_OUT", "DROP"])
    def _dup_up_3d_kernel(
        x_ptr, out_ptr, ROWS, T_OUT, H_OUT, W_OUT,
        sxb, sxc, sxt, sxh, sxw, DROP,
        C_OUT: tl.constexpr, FT: tl.constexpr, FS: tl.constexpr, REPEATS: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        # One row per output pixel (b, t', h', w') in channels-last-3d order; columns are its
        # output channels, stored contiguously.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        co = tl.arange(0, BLOCK_C)
        row_ok = rows < ROWS
        wo = rows % W_OUT
        rest = rows // W_OUT
        ho = rest % H_OUT
        rest = rest // H_OUT
        to = rest % T_OUT + DROP
        b = rest // T_OUT
        phase = ((to % FT) * FS + ho % FS) * FS + wo % FS
        src_c = (co[None, :] * (FT * FS * FS) + phase[:, None]) // REPEATS
        pixel = b * sxb + (to // FT) * sxt + (ho // FS) * sxh + (wo // FS) * sxw
        mask = row_ok[:, None] & (co[None, :] < C_OUT)
        v = tl.load(x_ptr + pixel[:, None] + src_c.to(tl.int64) * sxc, mask=mask)
        tl.store(out_ptr + rows[:, None] * C_OUT + co[None, :], v, mask=mask)


__all__ = ["DUP_UP_3D", "dup_up_3d", "dup_up_3d_reference", "dup_up_3d_shape",
           "dup_up_3d_unsupported"]
