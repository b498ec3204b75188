"""Softmax over the last dim of a contiguous tensor, in place or into another dtype.

The chunked attention (``vae_attention.attention_chunked``) takes one softmax per chunk of
query rows over all key tokens. torch's ``softmax`` writes a second tensor of that size; here
each row's probabilities overwrite its scores: one read and one write of the chunk, and one
score-sized tensor less alive. The Wan mid-block attention uses it (per-frame scores of a few
thousand keys, where it is twice as fast as torch's: the tiling note below); the KL wing's
attention keeps torch's softmax by default (``families/kl/settings.py`` says why).

Math: fp32 throughout (as torch computes for half inputs), ``exp(s - max) / sum``; rows up to
``ONE_PASS_MAX`` columns are held in registers (one read), longer ones are read twice, the
first pass keeping a running max and sum per lane. The probabilities differ from torch's by
fp32 rounding only, then one rounding to the output dtype.

Offsets are int64 (chunks of many rows times long rows pass 2^31 elements).
"""
from __future__ import annotations

import torch

from .accepts import Accepts, autograd_reason, contiguous, pow2
from .backend import launch, on_device, tl, triton

# Tiling by row length, chosen on an H200 (bf16 scores, ms per chunk against torch.softmax's):
# rows of 6144 keys in one pass at 8 warps 0.153 vs 0.301 (4 x 4096 rows); 16384 keys in one
# pass at 4 warps 0.402 vs 0.485 (8 and 16 warps: 0.61, 0.53); 65536 keys in two passes of
# 8192 columns at 16 warps 0.490 vs 0.494 (in one pass at 8-32 warps: 0.77-0.87, the row held
# in registers leaves one program per SM with nothing to overlap its load and store).
ONE_PASS_WARPS = ((8192, 8), (16384, 4))  # (up to this many columns, num_warps)
ONE_PASS_MAX = ONE_PASS_WARPS[-1][0]
TWO_PASS_BLOCK = 8192
TWO_PASS_WARPS = 16

SOFTMAX_ROWS = Accepts(min_rank=1, layout=contiguous, layout_reason="not contiguous")


def softmax_rows_reference(s: torch.Tensor, dtype: torch.dtype | None = None,
                           scale: float = 1.0) -> torch.Tensor:
    """torch's softmax of ``scale * s`` over the last dim (fp32 math), in ``dtype`` (default
    ``s``'s): the test oracle."""
    return torch.softmax(s.float() * scale, dim=-1).to(dtype or s.dtype)


def softmax_rows_unsupported(s: torch.Tensor, out: torch.Tensor | None = None,
                             scale: float = 1.0) -> str | None:
    """Why ``softmax_rows`` cannot take these tensors (short, for the log); None if it can."""
    reason = SOFTMAX_ROWS.tensor_reason(s)
    if reason is not None:
        return reason
    if not scale > 0:
        return f"scale {scale} (must be positive)"
    if out is not None and out is not s:
        if out.shape != s.shape or out.device != s.device or not out.is_contiguous():
            return "out differs from the scores in shape or device, or is not contiguous"
        if out.dtype not in SOFTMAX_ROWS.dtypes:
            return f"out dtype {out.dtype}"
    return autograd_reason(s, out)


def softmax_rows_config(columns: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_PASS, num_warps) for rows of ``columns``; the one place to tune."""
    if columns <= ONE_PASS_MAX:
        warps = next((w for limit, w in ONE_PASS_WARPS if columns <= limit), ONE_PASS_WARPS[-1][1])
        return pow2(columns), True, warps
    return TWO_PASS_BLOCK, False, TWO_PASS_WARPS


def softmax_rows(s: torch.Tensor, out: torch.Tensor | None = None,
                 scale: float = 1.0) -> torch.Tensor | None:
    """Softmax of ``scale * s`` over its last dim into ``out`` (default: ``s`` itself, in
    place); None, nothing written, when ``softmax_rows_unsupported`` gives a reason. ``scale``
    (> 0) is applied in fp32 to the loaded scores: an attention's 1/sqrt(d)."""
    if softmax_rows_unsupported(s, out, scale) is not None:
        return None
    out = s if out is None else out
    columns = s.shape[-1]
    rows = s.numel() // columns
    block, one_pass, num_warps = softmax_rows_config(columns)
    with on_device(s.device):
        launch(_softmax_rows_kernel, (rows,), s, out, columns, float(scale),
               BLOCK=block, ONE_PASS=one_pass, num_warps=num_warps)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["columns"])
    def _softmax_rows_kernel(s_ptr, out_ptr, columns, scale, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * columns
        cols = tl.arange(0, BLOCK)
        if ONE_PASS:
            mask = cols < columns
            x = tl.load(s_ptr + row + cols, mask=mask, other=-float("inf")).to(tl.float32) * scale
            e = tl.exp(x - tl.max(x, axis=0))  # masked lanes: exp(-inf) = 0
            y = e / tl.sum(e, axis=0)
            tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Per-lane running max and sum; a finite start keeps exp(m_old - m_new) defined in
            # lanes that have seen only masked columns.
            m = tl.full((BLOCK,), -1.0e30, tl.float32)
            d = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, columns, BLOCK):
                offs = start + cols
                x = tl.load(s_ptr + row + offs, mask=offs < columns,
                            other=-float("inf")).to(tl.float32) * scale
                m_new = tl.maximum(m, x)
                d = d * tl.exp(m - m_new) + tl.exp(x - m_new)
                m = m_new
            row_max = tl.max(m, axis=0)
            inv = 1.0 / tl.sum(d * tl.exp(m - row_max), axis=0)
            for start in range(0, columns, BLOCK):
                offs = start + cols
                mask = offs < columns
                x = tl.load(s_ptr + row + offs, mask=mask, other=0.0).to(tl.float32) * scale
                y = tl.exp(x - row_max) * inv
                tl.store(out_ptr + row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


__all__ = ["SOFTMAX_ROWS", "softmax_rows", "softmax_rows_config", "softmax_rows_reference",
           "softmax_rows_unsupported"]
