"""A causal 3-D conv's input in one pass: frames in front, the frames themselves, frames behind,
and reflected spatial borders, written into one channels-last-3d buffer.

LTX's ``CausalConv3d`` convolves ``[front frames | x | back frames]`` where the front frames are
cached frames of the previous chunk (ComfyUI 0.33's chunk state) or copies of x's first frame,
the back frames copies of its last frame (non-causal decoders), and reflect padding in space
(cuDNN has no reflect mode, so the border is part of the input). Assembled with torch copies
that is one strided copy per part and per border row and column: seven kernels per conv on
torch's generic (non-vectorised) copy path, 29.5 ms of a 166 ms LTX-2 768x512x121 decode on an
H200 (ComfyUI 0.33), against 5.9 ms for the norms that read and write the same bytes. Here each
output pixel row (C contiguous channels) is read once from wherever it comes from and written
once.

Math (``frame_pad_reference``, the twin and test oracle): with F front frames, T frames of x
and K back frames, output frame f is ``front[f]`` (or ``x[0]`` without a front tensor) for
f < F, ``x[f - F]`` for f < F + T, else ``x[T - 1]``; output row i reads row ``i - ph``
reflected into [0, H) (``-r`` below 0, ``2(H - 1) - r`` past the end), columns likewise. Pure
copies: the kernel's output is bit-identical to the twin's.

Layout: x and front channels-last-3d with dense pixels (any batch stride); the output is a new
contiguous channels-last-3d tensor. Offsets are int64 (a 1280x704 LTX-2 conv input with batch
is past 2^31 elements).
"""
from __future__ import annotations

import torch

from .accepts import FLOAT_DTYPES, Accepts, autograd_reason, pixels_dense, pow2
from .backend import launch, on_device, tl, triton

CL3D = torch.channels_last_3d
TILE_ELEMENTS = 4096
NUM_WARPS = 4
MAX_BLOCK_C = 8192

FRAME_PAD = Accepts(min_rank=5, max_rank=5, dtypes=FLOAT_DTYPES, layout=pixels_dense,
                    max_block_c=MAX_BLOCK_C)


def _out_shape(x: torch.Tensor, n_front: int, n_back: int, ph: int, pw: int) -> tuple[int, ...]:
    b, c, t, h, w = x.shape
    return (b, c, n_front + t + n_back, h + 2 * ph, w + 2 * pw)


def frame_pad_reference(x: torch.Tensor, front: torch.Tensor | None, n_front: int, n_back: int,
                        ph: int, pw: int) -> torch.Tensor:
    """The padded input with torch copies (``front``, when given, sets ``n_front``); always a
    new channels-last-3d tensor."""
    n_front = front.shape[2] if front is not None else n_front
    b, c, t, h, w = x.shape
    buf = torch.empty(_out_shape(x, n_front, n_back, ph, pw), dtype=x.dtype, device=x.device,
                      memory_format=CL3D)
    inner = buf[:, :, :, ph:ph + h, pw:pw + w]
    if front is not None:
        inner[:, :, :n_front].copy_(front)
    elif n_front:
        inner[:, :, :n_front].copy_(x[:, :, :1].expand(-1, -1, n_front, -1, -1))
    inner[:, :, n_front:n_front + t].copy_(x)
    if n_back:
        inner[:, :, n_front + t:].copy_(x[:, :, -1:].expand(-1, -1, n_back, -1, -1))
    for i in range(1, ph + 1):  # rows first, then whole columns: corners reflect in both
        buf[:, :, :, ph - i, pw:pw + w].copy_(buf[:, :, :, ph + i, pw:pw + w])
        buf[:, :, :, ph + h - 1 + i, pw:pw + w].copy_(buf[:, :, :, ph + h - 1 - i, pw:pw + w])
    for j in range(1, pw + 1):
        buf[..., pw - j].copy_(buf[..., pw + j])
        buf[..., pw + w - 1 + j].copy_(buf[..., pw + w - 1 - j])
    return buf


def frame_pad_unsupported(x: torch.Tensor, front: torch.Tensor | None, n_front: int, n_back: int,
                          ph: int, pw: int) -> str | None:
    """Why ``frame_pad`` cannot take these (short, for the log); None if it can."""
    reason = FRAME_PAD.tensor_reason(x) or FRAME_PAD.channels_reason(x.shape[1])
    if reason is not None:
        return reason
    if min(n_front, n_back, ph, pw) < 0:
        return "negative padding"
    if ph >= x.shape[3] or pw >= x.shape[4]:
        return "reflect padding as wide as the frame"
    if front is not None:
        if (not isinstance(front, torch.Tensor) or front.dim() != 5 or front.dtype != x.dtype
                or front.device != x.device or front.shape[:2] != x.shape[:2]
                or front.shape[3:] != x.shape[3:] or not pixels_dense(front)):
            return "front frames differ from the input in shape, layout, dtype or device"
    return autograd_reason(x, front)


def frame_pad(x: torch.Tensor, front: torch.Tensor | None, n_front: int, n_back: int,
              ph: int, pw: int) -> torch.Tensor:
    """``frame_pad_reference``'s tensor, in one Triton pass where ``frame_pad_unsupported``
    allows, else by the reference itself (same values either way)."""
    if frame_pad_unsupported(x, front, n_front, n_back, ph, pw) is not None:
        return frame_pad_reference(x, front, n_front, n_back, ph, pw)
    n_front = front.shape[2] if front is not None else n_front
    out = torch.empty(_out_shape(x, n_front, n_back, ph, pw), dtype=x.dtype, device=x.device,
                      memory_format=CL3D)
    b, c, t, h, w = x.shape
    _, _, t_out, h_out, w_out = out.shape
    rows = b * t_out * h_out * w_out
    block_c = pow2(c)
    block_p = max(1, TILE_ELEMENTS // block_c)
    src = front if front is not None else x  # unread without a front tensor (HAS_FRONT 0)
    grid = (-(-rows // block_p),)
    with on_device(x.device):
        launch(_frame_pad_kernel, grid,
               out, x, src, rows, c, t, h, w, t_out, h_out, w_out, n_front, ph, pw,
               x.stride(0), x.stride(2), x.stride(3), x.stride(4),
               src.stride(0), src.stride(2), src.stride(3), src.stride(4), int(front is not None),
               BLOCK_P=block_p, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return out


if triton is not None:

    # Sizes, padding and flags are unspecialised: one compilation per (dtype, BLOCK_C) serves
    # every conv and chunk of a decoder (the first-decode warm-up compiles it on a tiny input
    # of one frame without cached frames; a chunk with them must not need another variant).
    # C and the strides keep Triton's divisibility specialisation: it vectorises the rows.
    @triton.jit(do_not_specialize=["ROWS", "T", "H", "W", "T_OUT", "H_OUT", "W_OUT", "N_FRONT",
                                   "PH", "PW", "HAS_FRONT"])
    def _frame_pad_kernel(
        out_ptr, x_ptr, front_ptr, ROWS, C, T, H, W, T_OUT, H_OUT, W_OUT, N_FRONT, PH, PW,
        XSB, XST, XSH, XSW, FSB, FST, FSH, FSW, HAS_FRONT,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.arange(0, BLOCK_C)
        row_ok = rows < ROWS
        mask = row_ok[:, None] & (cols[None, :] < C)
        wo = rows % W_OUT
        ho = (rows // W_OUT) % H_OUT
        fo = (rows // (W_OUT * H_OUT)) % T_OUT
        bo = rows // (W_OUT * H_OUT * T_OUT)
        # Reflection of one bounce: PH < H and PW < W (frame_pad_unsupported).
        hi = ho - PH
        hi = tl.where(hi < 0, -hi, hi)
        hi = tl.where(hi >= H, 2 * (H - 1) - hi, hi)
        wi = wo - PW
        wi = tl.where(wi < 0, -wi, wi)
        wi = tl.where(wi >= W, 2 * (W - 1) - wi, wi)
        ti = tl.minimum(tl.maximum(fo - N_FRONT, 0), T - 1)  # front copies x[0], back x[T-1]
        x_off = bo * XSB + ti * XST + hi * XSH + wi * XSW
        in_front = (fo < N_FRONT) & (HAS_FRONT != 0)
        f_off = bo * FSB + fo * FST + hi * FSH + wi * FSW
        v_front = tl.load(front_ptr + f_off[:, None] + cols[None, :],
                          mask=mask & in_front[:, None], other=0.0)
        v_x = tl.load(x_ptr + x_off[:, None] + cols[None, :],
                      mask=mask & ~in_front[:, None], other=0.0)
        v = tl.where(in_front[:, None], v_front, v_x)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], v, mask=mask)
