"""The tail of ComfyUI's Wan ``RMS_norm`` in one pass, rounding exactly where stock rounds.

Stock (``comfy.ldm.wan.vae.RMS_norm.forward``) is
``F.normalize(x, dim=1) * scale * gamma.to(x) + (bias.to(x) if bias is not None else 0)``:
after the norm reduction, four elementwise passes over x (divide, two multiplies, add), each
reading and writing the whole tensor and rounding its result to x.dtype. Here the reduction is
left to torch (``x.norm(2, 1, keepdim=True).clamp_min(eps)``, the very call ``F.normalize``
makes, so ``denom`` is identical) and one kernel does the rest, with every intermediate
rounded to x.dtype as the stock pass would have stored it:

    q  = rnd(x / denom)        IEEE division (``div_rn``), as CUDA's ``/`` without fast math
    r1 = rnd(q * scale)        scale is an fp32 scalar, as torch's opmath for a Python float
    r2 = rnd(r1 * gamma)
    y  = rnd(r2 + bias)        bias 0 (an int in stock) still turns -0.0 into +0.0

computed in fp32 (torch's opmath for half types; exact for fp32) with fp contraction off (an
FMA would skip a rounding). The result is bit-identical to stock, which the tests check with
``torch.equal``; it is what the lossless path may use. Layout: contiguous (N, C, *spatial),
the stock layout, tiled along the contiguous spatial axis.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .accepts import Accepts, autograd_reason, contiguous
from .backend import interpreting, launch, on_device, tl, triton

# What the kernel takes: the stock (N, C, *spatial) layout; the batch is grid axis 2.
RMS_NORM_EXACT = Accepts(min_rank=3, layout=contiguous, layout_reason="not contiguous",
                         max_batch=65535)
BLOCK_S = 1024
BLOCK_C = 4
NUM_WARPS = 4


def rms_norm_exact_reference(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
                             scale: float, eps: float = 1e-12) -> torch.Tensor:
    """ComfyUI's formula itself (channel-first): the oracle the kernel must equal bit for bit."""
    return F.normalize(x, dim=1, eps=eps) * scale * gamma.to(x) + (bias.to(x) if bias is not None else 0)


def rms_norm_exact_denominator(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """What ``F.normalize`` divides by (same call, same result)."""
    return x.norm(2, 1, keepdim=True).clamp_min(eps)


def rms_norm_exact_unsupported(x, gamma, bias) -> str | None:
    if not isinstance(x, torch.Tensor):
        return "needs an (N, C, *spatial) tensor"
    reason = RMS_NORM_EXACT.tensor_reason(x)
    if reason is not None:
        return reason
    if interpreting() and x.dtype == torch.bfloat16:
        # The interpreter converts fp32 to bf16 by truncation, not round-to-nearest-even.
        return "the Triton interpreter rounds bf16 by truncation"
    for name, p in (("gamma", gamma), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor) or p.numel() != x.shape[1]:
            return f"{name} is not one value per channel"
        if p.device != x.device:
            return f"{name} on {p.device}, input on {x.device}"
    return autograd_reason(x)


def rms_norm_exact(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
                   scale: float, eps: float = 1e-12) -> torch.Tensor | None:
    """``rms_norm_exact_reference(...)`` bit for bit, or None (``rms_norm_exact_unsupported``)."""
    if rms_norm_exact_unsupported(x, gamma, bias) is not None:
        return None
    n, c = x.shape[0], x.shape[1]
    spatial = x.numel() // (n * c)
    denom = rms_norm_exact_denominator(x, eps)
    # Stock casts gamma (and bias) to x's dtype before multiplying: same values here.
    g = gamma.to(x).reshape(-1).contiguous()
    b = bias.to(x).reshape(-1).contiguous() if bias is not None else g
    out = torch.empty_like(x)
    grid = (-(-spatial // BLOCK_S), -(-c // BLOCK_C), n)  # host arithmetic: triton.cdiv is slow
    with on_device(x.device):
        launch(_rms_norm_exact_kernel, grid, x, denom, g, b, out, spatial, c, float(scale),
               HAS_BIAS=bias is not None, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C,
               num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["S", "C"])
    def _rms_norm_exact_kernel(x_ptr, d_ptr, g_ptr, b_ptr, y_ptr, S, C, scale,
                               HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_C: tl.constexpr):
        # int64: N * C * S exceeds 2**31 for long Wan decodes.
        n = tl.program_id(2).to(tl.int64)
        s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        s_ok = s < S
        c_ok = c < C
        mask = c_ok[:, None] & s_ok[None, :]
        offs = (n * C + c[:, None]) * S + s[None, :]
        dt = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + offs, mask=mask, other=1.0).to(tl.float32)
        d = tl.load(d_ptr + n * S + s, mask=s_ok, other=1.0).to(tl.float32)
        g = tl.load(g_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, d[None, :]).to(dt).to(tl.float32)
        r1 = (q * scale).to(dt).to(tl.float32)
        r2 = (r1 * g[:, None]).to(dt).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            y = r2 + b[:, None]
        else:
            y = tl.where(r2 == 0.0, 0.0, r2)  # stock adds 0: -0.0 + 0 is +0.0
        tl.store(y_ptr + offs, y.to(dt), mask=mask)


__all__ = ["rms_norm_exact", "rms_norm_exact_denominator", "rms_norm_exact_reference",
           "rms_norm_exact_unsupported"]
