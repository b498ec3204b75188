"""In-place per-channel bias (+ residual) add on channels-last tensors: ``out += bias (+ res)``.

PyTorch adds a conv's bias as a separate broadcast kernel after cuDNN's convolution. On a
channels-last output that broadcast takes torch's generic (non-vectorised) elementwise path,
about 2.5x slower than the memory floor, and a residual add then costs one more pass. In a KL
decoder at 1024² those adds were 6.3 ms of a 24.5 ms fast decode. Here one pass reads ``out``
(and ``res``), adds the bias in fp32 and writes ``out``.

Addends: up to two more tensors of ``out``'s shape, dtype and strides join the same sum, so a
conv computed as per-tap partial outputs is summed and biased in this one pass.

Layout: channels innermost and dense (NHWC or NDHWC, any batch; size-1 dims may have any
stride, so a batch-1 time slice of a channels-last-3d buffer qualifies). Each program owns a
[BLOCK_P, BLOCK_C] tile of whole pixels, so the channel index is the tile column (no modulo)
and loads along C are contiguous. Row offsets are int64 (a 2048² 128-channel batch of four
exceeds 2^31 elements). One power-of-two tile even where it masks a quarter of its lanes (Wan's
C = 3 * 2^k): three unmasked C/3 tiles, which brought ``rms_norm_silu`` to copy speed, were
slower here (H200, bf16, bias + residual: 192 x 2 x 240 x 416 2.57 -> 1.90 TB/s, 96 x 2 x 480 x
832 bias only 2.88 -> 2.59, a copy 3.3-3.8; session 20's probe, docs/benchmark/c435b93-s20).

Rounding: the sum is formed in fp32 (order: out, addends, bias, residual) and rounded once to
``out.dtype``; stock rounds after each add, so half-precision results may differ by one ULP.
"""
from __future__ import annotations

import torch

from .accepts import Accepts, autograd_reason, channels_inner_dense, pow2, same_layout
from .backend import launch, on_device, tl, triton

TILE_ELEMENTS = 4096
NUM_WARPS = 4
MAX_BLOCK_C = 8192
# The kernel has one pointer argument per addend; more would need a variadic kernel.
MAX_ADDENDS = 2

# What the kernel takes as ``out`` (``bias_residual_add_unsupported`` asks this).
BIAS_RESIDUAL_ADD = Accepts(min_rank=2, layout=channels_inner_dense, max_block_c=MAX_BLOCK_C)


def bias_residual_add_reference(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    *,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """``out + addends... + bias (+ residual)`` in fp32 in that order, rounded once to out.dtype,
    in out's layout (new tensor).

    The test oracle of ``bias_residual_add_`` (where the kernel declines, callers add with
    torch's own ops).
    """
    y = out.float()
    for a in addends:
        y = y + a.float()
    if bias is not None:
        y = y + bias.float().reshape((1, -1) + (1,) * (out.dim() - 2))
    if residual is not None:
        y = y + residual.float()
    return y.to(out.dtype)  # ``to`` keeps the (dense) strides of ``out``


def bias_residual_add_unsupported(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    *,
    addends: tuple[torch.Tensor, ...] = (),
) -> str | None:
    """Why ``bias_residual_add_`` cannot take these tensors (short, for the log); None if it can."""
    reason = BIAS_RESIDUAL_ADD.tensor_reason(out) or BIAS_RESIDUAL_ADD.channels_reason(out.shape[1])
    if reason is not None:
        return reason
    c = out.shape[1]
    if not isinstance(addends, (tuple, list)):
        return f"addends is {type(addends).__name__}, not a tuple"
    if len(addends) > MAX_ADDENDS:
        return f"{len(addends)} addends (at most {MAX_ADDENDS})"
    if bias is None and residual is None and not addends:
        return "nothing to add"
    if bias is not None:
        if bias.numel() != c or bias.device != out.device or not bias.is_floating_point():
            return "bias does not match the output's channels/device"
    if residual is not None:
        if (not same_layout(residual, out)
                or residual.dtype != out.dtype or residual.device != out.device):
            return "residual differs from the output in shape, layout, dtype or device"
    for i, a in enumerate(addends):
        if (not isinstance(a, torch.Tensor) or not same_layout(a, out)
                or a.dtype != out.dtype or a.device != out.device):
            return f"addend {i} differs from the output in shape, layout, dtype or device"
    reason = autograd_reason(out, bias, residual, *addends)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():
        return "torch.compile tracing"
    return None


def sum_biases(*biases: torch.Tensor | None) -> torch.Tensor | None:
    """One bias for several convs whose outputs are added (None when none has one): summed in
    fp32 and rounded once, where stock rounds after each conv's own bias add."""
    present = [b for b in biases if b is not None]
    if not present:
        return None
    return torch.stack([b.float() for b in present]).sum(0).to(present[0].dtype)


def bias_residual_add_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    *,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor | None:
    """``out += addends... + bias (+ residual)`` in place; returns ``out``, or None when
    unsupported (``bias_residual_add_unsupported`` says why; the caller falls back to torch ops).

    ``residual`` and the addends may be ``out`` itself (each element is read before it is
    written, by the same program) but must not partly overlap it.
    """
    if bias_residual_add_unsupported(out, bias, residual, addends=addends) is not None:
        return None
    c = out.shape[1]
    block_c = pow2(c)
    block_p = max(1, TILE_ELEMENTS // block_c)
    rows = out.numel() // c
    bias_arg = out if bias is None else bias.contiguous()
    res_arg = out if residual is None else residual
    # Absent operands get ``out`` as a placeholder pointer; their flags keep it unread.
    a0, a1 = (tuple(addends) + (out, out))[:2]
    grid = (-(-rows // block_p),)  # host arithmetic (triton.cdiv is slow from Python)
    with on_device(out.device):
        launch(_bias_residual_add_kernel, grid,
            out, a0, a1, bias_arg, res_arg, rows,
            len(addends), int(bias is not None), int(residual is not None),
            C=c, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=NUM_WARPS,
        )
    return out


if triton is not None:

    # One compilation per (C, dtypes), any size: which operands are present is a runtime flag
    # (uniform branches, free in this memory-bound pass), not a variant per combination to
    # compile at first decode (Wan 2.1 met 8 variants, 5 as flags).
    @triton.jit(do_not_specialize=["ROWS", "n_addends", "has_bias", "has_res"])
    def _bias_residual_add_kernel(
        out_ptr, a0_ptr, a1_ptr, bias_ptr, res_ptr, ROWS, n_addends, has_bias, has_res,
        C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]
        c = tl.arange(0, BLOCK_C)[None, :]
        c_ok = c < C
        mask = (rows < ROWS) & c_ok
        offs = rows * C + c
        y = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Addends share out's offsets (same strides, checked); the reference's order of adds.
        if n_addends >= 1:
            y += tl.load(a0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if n_addends >= 2:
            y += tl.load(a1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if has_bias != 0:
            y += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        if has_res != 0:
            y += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


__all__ = [
    "sum_biases",
    "bias_residual_add_",
    "bias_residual_add_reference",
    "bias_residual_add_unsupported",
]
