"""Nearest-2x upsample followed by a 3x3 conv, folded into one low-resolution operation.

The KL decoder's ``Upsample`` is ``interpolate(x, scale_factor=2, mode="nearest")`` then a
3x3 conv (stride 1, padding 1, zeros). Per axis, with ``u[Y] = x[Y // 2]`` and the conv a
cross-correlation ``out[Y] = w0*u[Y-1] + w1*u[Y] + w2*u[Y+1]``:

    out[2m]   = w0*x[m-1] + (w1+w2)*x[m]
    out[2m+1] = (w0+w1)*x[m] + w2*x[m+1]

and the conv's zero padding of ``u`` is exactly zero padding of ``x`` (``u[-1]`` and ``u[2H]``
both come from the missing ``x[-1]`` / ``x[H]``). So every output pixel reads a 2x2 window of
``x`` with 3x3 taps summed in groups: 4 multiply-adds per output instead of 9.

Two ways to run it (the faster one on a given GPU is chosen by the caller):

- ``upsample_conv_folded``: one ``conv_transpose2d`` (kernel 4, stride 2, padding 1). Its
  ``out[Y] = sum x[m] * W[k]`` over ``Y = 2m + k - 1`` gives, per axis,
  ``W = [w2, w1+w2, w0+w1, w0]``.
- ``upsample_conv_subpixel``: one 2x2 ``conv2d`` over ``x`` padded by 1 (output (H+1)x(W+1),
  4*Cout channels, one per output phase) then ``pixel_shuffle`` and a crop of one high-res
  pixel on each side. Phase 0 (even rows) reads window ``(m-1, m)`` and phase 1 (odd rows)
  ``(m, m+1)``; with a padded 2x2 conv, output row ``p`` reads ``(p-1, p)``, so phase 0 sits at
  ``p = m`` and phase 1 at ``p = m + 1``. Shifting the high-res grid by one (``Y + 1 = 2p + s``)
  puts phase 1 in shuffle slot ``s = 0`` and phase 0 in slot ``s = 1`` for the same ``p``; the
  crop ``[1 : 2H+1]`` undoes the shift. Per axis: slot 0 taps ``[w0+w1, w2]``, slot 1 taps
  ``[w0, w1+w2]``.

Both are exact up to float rounding (the folded taps are sums, and the summation order
changes); ``upsample_conv_reference`` is the stock computation and the test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Per axis, rows map the three 3x3 taps (w0, w1, w2) to the folded taps.
_TRANSPOSED_TAPS = ((0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 0, 0))  # conv_transpose2d k=0..3
_SUBPIXEL_TAPS = (  # [shuffle slot][tap over window (p-1, p)]
    ((1, 1, 0), (0, 0, 1)),  # slot 0 = odd output rows/cols
    ((1, 0, 0), (0, 1, 1)),  # slot 1 = even output rows/cols
)


def _fold_dtype(weight: torch.Tensor) -> torch.dtype:
    # Folded taps are sums of up to four 3x3 taps. Summed in fp32 (24-bit significand) the
    # bf16/fp16 partial sums carry fp32-sized error at most, so the one final cast back to the
    # weight dtype is the only rounding that matters, and fp16 partial sums cannot overflow;
    # summing in bf16/fp16 would round after every add (up to 3 roundings of 2^-9 each).
    # fp64 weights stay fp64 so the fp64 equivalence tests stay tight.
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3):
        raise ValueError(f"expected a 3x3 conv weight [Cout, Cin, 3, 3], got {tuple(weight.shape)}")


def fold_upsample_conv_weight(weight_3x3: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, 3, 3] conv weight -> [Cin, Cout, 4, 4] ``conv_transpose2d`` weight.

    ``conv_transpose2d(x, result, bias, stride=2, padding=1)`` equals
    ``conv2d(interpolate(x, scale_factor=2, mode="nearest"), weight_3x3, bias, padding=1)``.
    """
    _check_weight(weight_3x3)
    work = _fold_dtype(weight_3x3)
    taps = torch.tensor(_TRANSPOSED_TAPS, dtype=work, device=weight_3x3.device)
    folded = torch.einsum("ka,oiab,lb->iokl", taps, weight_3x3.to(work), taps)
    return folded.to(weight_3x3.dtype).contiguous()


def fold_upsample_conv_weight_subpixel(weight_3x3: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, 3, 3] conv weight -> [4*Cout, Cin, 2, 2] weight for ``upsample_conv_subpixel``.

    Output channel ``4*c + 2*i + j`` is output channel ``c`` at shuffle slot ``(i, j)``, the
    order ``pixel_shuffle(…, 2)`` reads.
    """
    _check_weight(weight_3x3)
    work = _fold_dtype(weight_3x3)
    taps = torch.tensor(_SUBPIXEL_TAPS, dtype=work, device=weight_3x3.device)  # [2, 2, 3]
    folded = torch.einsum("ika,ocab,jlb->oijckl", taps, weight_3x3.to(work), taps)
    cout, cin = weight_3x3.shape[:2]
    return folded.reshape(4 * cout, cin, 2, 2).to(weight_3x3.dtype).contiguous()


def upsample_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The stock computation: nearest 2x upsample, then 3x3 conv with padding 1."""
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, padding=1)


def upsample_conv_folded(
    x: torch.Tensor, folded_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``upsample_conv_reference`` with the weight from ``fold_upsample_conv_weight``."""
    return F.conv_transpose2d(x, folded_weight, bias, stride=2, padding=1)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def upsample_conv_subpixel(
    x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``upsample_conv_reference`` with the weight from ``fold_upsample_conv_weight_subpixel``.

    ``bias`` may be the conv's own [Cout] bias or one already repeated to [4*Cout]
    (``bias.repeat_interleave(4)``; callers that cache it save a tiny kernel per call).
    The result is contiguous in ``x``'s memory format (channels-last in, channels-last out).
    """
    if bias is not None and bias.numel() * 4 == w4.shape[0]:
        bias = bias.repeat_interleave(4)
    h, w = x.shape[-2:]
    y = F.pixel_shuffle(F.conv2d(x, w4, bias, padding=1), 2)  # [N, Cout, 2H+2, 2W+2]
    return y[:, :, 1 : 2 * h + 1, 1 : 2 * w + 1].contiguous(memory_format=_memory_format(x))


__all__ = [
    "fold_upsample_conv_weight",
    "fold_upsample_conv_weight_subpixel",
    "upsample_conv_folded",
    "upsample_conv_reference",
    "upsample_conv_subpixel",
]
