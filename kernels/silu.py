"""SiLU inside the norm kernels, in two forms: the library's (``tl.sigmoid``) or the MUFU one.

``y * sigmoid(y)`` through ``tl.sigmoid`` compiles for sm_90 to about nine instructions per
element: ``ex2.approx`` and ``rcp.approx`` each wrapped in the range fix-ups that keep
denormals (a compare, a select and a multiply around each), plus the scaling multiplies. The
GroupNorm apply pass then spends about 15 instructions per element (632 SASS instructions per
32-element thread tile at C=128, Triton 3.8, ptxas for sm_90a): at the H200's 4.8 TB/s a
pass of 2 bytes in and 2 out per element needs ~3.8 elements per clock per SM, which that
makes ~1.8 of the 4 warp instructions an SM issues per clock, and half its MUFU rate. Whether
that limits a pass is measured by the families (their ``fast_silu`` settings: off, since on an
H100 the norms were bandwidth-bound and moved about 1%).

The fast form issues the two approximations with flush-to-zero and nothing around them:
``y * rcp(1 + ex2(-y * log2(e)))``, five instructions (the apply pass: 408 per tile). What it
gives up: results that the exact form would return as fp32 denormals come out as zero
(``silu(y)`` for y < -87.3, where the true value is about 1e-36 in magnitude or less), and
``rcp.approx`` is within 1 ulp where ``div.full`` is within 2; both far below bf16's rounding
step. ``1 + e`` is at least 1, so the reciprocal never meets a denormal or zero; e = inf
(y < -88.7) gives -0, the sign of the exact limit.

Inline PTX runs on NVIDIA GPUs only: not under ``TRITON_INTERPRET`` and not on ROCm
(``fast_silu_reason``). Kernels take the form as a constexpr, so each form is its own variant.
"""
from __future__ import annotations

import torch

from .backend import interpreting, tl, triton

# The families' default (``KLSettings.fast_silu``, ``WanSettings.fast_silu``).
FAST_SILU = False


def fast_silu_reason(device: torch.device) -> str | None:
    """Why the MUFU form cannot be compiled for tensors on ``device``; None where it can."""
    if device.type != "cuda":
        return f"{device.type} tensor"
    if interpreting():
        return "Triton interpreter (no inline PTX)"
    if getattr(torch.version, "hip", None):
        return "ROCm (no inline PTX)"
    return None


def use_fast_silu(wanted: bool, device: torch.device) -> bool:
    """The form a launch compiles: the fast one where asked for and ``device`` can take it."""
    return bool(wanted) and fast_silu_reason(device) is None


if triton is not None:

    _NEG_LOG2_E = tl.constexpr(-1.4426950408889634)

    @triton.jit
    def silu_f32(y, FAST: tl.constexpr):
        """SiLU of an fp32 tile; ``FAST``: the MUFU form (module note)."""
        if FAST:
            e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [y * _NEG_LOG2_E],
                                          dtype=tl.float32, is_pure=True, pack=1)
            r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e],
                                          dtype=tl.float32, is_pure=True, pack=1)
            return y * r
        else:
            return y * tl.sigmoid(y)
else:
    silu_f32 = None  # importable without Triton (the kernels that call it are not defined)
