"""A convolution to few output channels (a decoder's head: 128 -> 3, Wan's 96 -> 3 over three
frames) as per-tap products and a shifted sum, in two Triton passes.

A direct convolution to 3 channels leaves the tensor cores almost idle and reads every input
pixel once per spatial tap (9 times; cuDNN reaches about 20 TFLOP/s on the SDXL head, where
the input alone is 268 MB). Here:

1. ``tap products``: every input pixel is multiplied once by all spatial taps' weights at once,
   a GEMM of K = KT * Cin (the temporal taps are summed here, as an implicit GEMM over frames:
   ``implicit_gemm_conv`` with a KT x 1 x 1 kernel) and N = KH * KW * Cout columns
   (27 for a 3x3 head to 3 channels, padded to 32), kept in fp32: P[pixel, (kh, kw, co)].
2. ``tap sum``: each output pixel adds the KH * KW products its taps point at,
   ``out[h, w, co] = bias[co] + sum P[h + kh - ph, w + kw - pw, (kh, kw, co)]`` (zero where a
   tap leaves the image: the conv's zero padding), in fp32, rounded once to the input dtype.

The input is read once; the products make one round trip (128 bytes per pixel for a 3x3 head
to 3 channels, half the input's 256 at 128 channels). The MACs are the convolution's own.

Rounding: the products are exact fp32 sums of bf16/fp16 products; the tap sum adds KH * KW
fp32 values and the bias and rounds once (stock rounds the conv output, then the bias add).

``prologue`` (2-D convs): the conv of ``silu(x * scale + shift)`` for a norm folded to
per-(sample, channel) factors (``group_norm_silu.NormSiLU``), applied in pass 1 as each tile
is loaded and rounded to x's dtype before the product, as a norm pass would have stored it. A
decoder's final norm + SiLU then never writes its output: pass 1 reads x once, as before, and
the norm's own write and this conv's read of it are gone (268 MB each at SDXL 1024²). Pass 1 of
a 2-D conv has no spatial taps, so every element it loads is a real input pixel and the
prologue needs no padding rule; the spatial zero padding stays in pass 2, after it, as in the
unfused conv. Not for 3-D inputs, whose pass 1 masks the temporal padding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .accepts import Accepts, autograd_reason, channel_stride_one, pow2
from .backend import interpreting, launch, on_device, tl, triton
from .group_norm_silu import NormSiLU
from .implicit_gemm_conv import (
    IMPLICIT_GEMM_CONV,
    ConvConfig,
    default_config,
    implicit_gemm_conv,
    implicit_gemm_conv_reference,
)
from .silu import silu_f32, use_fast_silu

MAX_COLUMNS = 256  # spatial taps x output channels, one fp32 product row per pixel
BLOCK_P = 256  # output pixels per tap-sum program
NUM_WARPS = 4

# What the kernels take as the input ``x`` (``narrow_conv_unsupported`` asks this).
NARROW_CONV = Accepts(
    min_rank=4, max_rank=5, dtypes=IMPLICIT_GEMM_CONV.dtypes,
    layout=channel_stride_one, layout_reason="channels not innermost",
)


@dataclass(frozen=True)
class NarrowWeight:
    """A conv weight packed for ``narrow_conv``: ``taps`` is the tap-products GEMM's B operand,
    (KT, 1, 1, Cin, columns) with column ``(kh * KW + kw) * Cout + co``, zero-padded to a
    power of two (at least 16, the smallest tensor-core tile)."""

    taps: torch.Tensor
    cout: int
    kh: int
    kw: int

    @property
    def kt(self) -> int:
        return self.taps.shape[0]


def pack_narrow_conv_weight(weight: torch.Tensor) -> NarrowWeight:
    """[Cout, Cin, (KT,) KH, KW] conv weight -> ``NarrowWeight``."""
    if weight.dim() == 4:
        weight = weight.unsqueeze(2)
    if weight.dim() != 5:
        raise ValueError(f"expected a 2-D or 3-D conv weight, got shape {tuple(weight.shape)}")
    cout, cin, kt, kh, kw = weight.shape
    columns = kh * kw * cout
    taps = weight.new_zeros((kt, 1, 1, cin, max(16, pow2(columns))))
    # (co, c, kt, kh, kw) -> (kt, c, kh, kw, co): the column index runs (kh, kw, co)
    taps[:, 0, 0, :, :columns] = weight.permute(2, 1, 3, 4, 0).reshape(kt, cin, columns)
    return NarrowWeight(taps.contiguous(), cout, kh, kw)


def narrow_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          padding=1, prologue: NormSiLU | None = None) -> torch.Tensor:
    """The test oracle: fp32 convolution + bias, rounded once, channels-last; with a
    ``prologue``, of ``prologue_reference(x, prologue)``."""
    if prologue is not None:
        x = prologue_reference(x, prologue)
    return implicit_gemm_conv_reference(x, weight, bias, padding)


def prologue_reference(x: torch.Tensor, prologue: NormSiLU) -> torch.Tensor:
    """What pass 1 convolves under a ``prologue``: ``x * scale + shift`` (+ SiLU) in fp32,
    rounded to x's dtype (the plain-torch twin)."""
    n, c = x.shape[:2]
    view = (n, c) + (1,) * (x.dim() - 2)
    y = x.float() * prologue.scale.float().reshape(view) + prologue.shift.float().reshape(view)
    if prologue.silu:
        y = y * torch.sigmoid(y)
    return y.to(x.dtype)


def _pads(padding, rank: int) -> tuple[int, int, int]:
    pad = (padding,) * (rank - 2) if isinstance(padding, int) else tuple(padding)
    return (0, *pad) if rank == 4 else pad


def _prologue_reason(x: torch.Tensor, prologue: NormSiLU | None) -> str | None:
    if prologue is None:
        return None
    if x.dim() != 4:
        return "a prologue on a 3-D conv"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "a prologue needs a dense channels-last input"  # pass 1 indexes pixels densely
    for name, t in (("scale", prologue.scale), ("shift", prologue.shift)):
        if (t.dtype != torch.float32 or t.device != x.device
                or tuple(t.shape) != tuple(x.shape[:2]) or not t.is_contiguous()):
            return f"prologue {name} is not a contiguous fp32 [n, C] on the input's device"
    return None


def narrow_conv_unsupported(x: torch.Tensor, weight: NarrowWeight, padding=1,
                            bias: torch.Tensor | None = None,
                            prologue: NormSiLU | None = None) -> str | None:
    """Why ``narrow_conv`` cannot take these tensors (short, for the log); None if it can."""
    reason = NARROW_CONV.tensor_reason(x) or _prologue_reason(x, prologue)
    if reason is not None:
        return reason
    if not isinstance(weight, NarrowWeight):
        return "weight not packed by pack_narrow_conv_weight"
    taps = weight.taps
    if x.dim() == 4 and weight.kt != 1:
        return "a 3-D weight for a 4-D input"
    if taps.shape[3] != x.shape[1]:
        return f"weight takes {taps.shape[3]} channels, input has {x.shape[1]}"
    if taps.dtype != x.dtype or taps.device != x.device:
        return "weight differs from the input in dtype or device"
    if taps.shape[4] > MAX_COLUMNS:
        return f"{weight.kh}x{weight.kw} taps x {weight.cout} outputs (at most {MAX_COLUMNS})"
    pt, ph, pw = pads = _pads(padding, x.dim())
    if len(pads) != 3 or min(pads) < 0 or ph >= weight.kh or pw >= weight.kw:
        return f"padding {padding}"
    t = x.shape[2] if x.dim() == 5 else 1
    h, w = x.shape[-2:]
    if t + 2 * pt < weight.kt or h + 2 * ph < weight.kh or w + 2 * pw < weight.kw:
        return "kernel larger than the padded input"
    if bias is not None and (bias.numel() != weight.cout or bias.device != x.device
                             or not bias.is_floating_point()):
        return "bias does not match the output's channels/device"
    return autograd_reason(x, taps, bias)


def narrow_conv(x: torch.Tensor, weight: NarrowWeight, padding=1,
                bias: torch.Tensor | None = None,
                config: ConvConfig | None = None,
                prologue: NormSiLU | None = None,
                fast_silu: bool = False) -> torch.Tensor | None:
    """``conv(x, weight, padding) + bias``, stride 1, for a weight packed by
    ``pack_narrow_conv_weight``: a new channels-last(-3d) tensor in ``x.dtype``, or None when
    unsupported (``narrow_conv_unsupported`` says why). ``config``: the tap-products tiling;
    ``prologue``: convolve the normalised input instead (the module's note), SiLU in its MUFU
    form where ``fast_silu`` asks and the device takes it."""
    if narrow_conv_unsupported(x, weight, padding, bias, prologue) is not None:
        return None
    pt, ph, pw = _pads(padding, x.dim())
    time_pad = 0 if x.dim() == 4 else (pt, 0, 0)
    if config is None:
        # Output frames innermost: the frames the temporal taps share are read while cached.
        config = replace(default_config(x.shape[1], weight.taps.shape[4]),
                         time_inner=weight.kt > 1)
    if prologue is not None:
        products = _prologue_products(x, weight.taps, prologue, config, fast_silu)
    else:
        products = implicit_gemm_conv(x, weight.taps, time_pad, config=config,
                                      out_dtype=torch.float32)
    if products is None:  # the checks above are implicit_gemm_conv's; a decline is a bug
        raise RuntimeError("implicit_gemm_conv declined the tap products")
    p5 = products if products.dim() == 5 else products.unsqueeze(2)
    n, columns, t, h, w = p5.shape
    h_out, w_out = h + 2 * ph - weight.kh + 1, w + 2 * pw - weight.kw + 1
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    shape = (n, weight.cout, h_out, w_out) if x.dim() == 4 else (n, weight.cout, t, h_out, w_out)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    pixels = n * t * h_out * w_out
    with on_device(x.device):
        launch(_tap_sum_kernel, (-(-pixels // BLOCK_P),),
            p5, bias if bias is not None else p5, out, pixels, h, w, h_out, w_out,
            COUT=weight.cout, COLUMNS=columns, KH=weight.kh, KW=weight.kw, PAD_H=ph, PAD_W=pw,
            BLOCK_P=BLOCK_P, BLOCK_C=pow2(weight.cout), HAS_BIAS=bias is not None,
            num_warps=NUM_WARPS,
        )
    return out


def _prologue_products(x: torch.Tensor, taps: torch.Tensor, prologue: NormSiLU,
                       config: ConvConfig, fast_silu: bool) -> torch.Tensor:
    """Pass 1 under a prologue (2-D x): the fp32 products of ``silu(x * scale + shift)`` as
    ``implicit_gemm_conv`` lays them out, a channels-last [n, columns, h, w] tensor."""
    n, c, h, w = x.shape
    columns = taps.shape[4]
    hw = h * w
    out = torch.empty((n, columns, h, w), dtype=torch.float32, device=x.device,
                      memory_format=torch.channels_last)
    with on_device(x.device):
        launch(_prologue_products_kernel, (-(-hw // config.block_m), n),
            x, taps, prologue.scale, prologue.shift, out, hw, c,
            COLUMNS=columns, SILU=bool(prologue.silu),
            FAST_SILU=use_fast_silu(fast_silu, x.device), DOT_FP32=interpreting(),
            BLOCK_M=config.block_m, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["HW", "C"])
    def _prologue_products_kernel(
        x_ptr, w_ptr, scale_ptr, shift_ptr, p_ptr, HW, C,
        COLUMNS: tl.constexpr, SILU: tl.constexpr, FAST_SILU: tl.constexpr,
        DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Rows are the pixels of sample n (channels-last: row p starts at (n * HW + p) * C, int64
        # since n * HW * C can pass 2^31); columns the packed (kh, kw, co) taps, all of them in one
        # tile (at most MAX_COLUMNS). The normalised tile is rounded to x's dtype before the
        # product: the values a norm pass would have stored and the unfused conv read.
        pid = tl.program_id(0)
        n = tl.program_id(1)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < HW
        row_off = (n.to(tl.int64) * HW + rows) * C
        cols = tl.arange(0, COLUMNS)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, COLUMNS), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_K):
            k = c0 + ks
            k_ok = k < C
            a = tl.load(x_ptr + row_off[:, None] + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            scale = tl.load(scale_ptr + n * C + k, mask=k_ok, other=0.0)
            shift = tl.load(shift_ptr + n * C + k, mask=k_ok, other=0.0)
            y = a.to(tl.float32) * scale[None, :] + shift[None, :]
            if SILU:
                y = silu_f32(y, FAST_SILU)
            # Channels past C meet zero weight rows; rows past HW are never stored.
            a = y.to(x_ptr.dtype.element_ty)
            b = tl.load(w_ptr + k[:, None] * COLUMNS + cols[None, :], mask=k_ok[:, None],
                        other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        tl.store(p_ptr + (n.to(tl.int64) * HW + rows)[:, None] * COLUMNS + cols[None, :], acc,
                 mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["PIXELS", "H", "W", "H_OUT", "W_OUT"])
    def _tap_sum_kernel(
        p_ptr, bias_ptr, out_ptr, PIXELS, H, W, H_OUT, W_OUT,
        COUT: tl.constexpr, COLUMNS: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        PAD_H: tl.constexpr, PAD_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        # Products and output are dense channels-last(-3d): pixel (frame f, h, w) is row
        # (f * H + h) * W + w of P, COLUMNS wide, and row (f * H_OUT + h) * W_OUT + w of the
        # output, COUT wide (f runs over batch x frames, the same in both).
        pix = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = pix < PIXELS
        w_o = pix % W_OUT
        r = pix // W_OUT
        h_o = r % H_OUT
        frame = r // H_OUT
        co = tl.arange(0, BLOCK_C)
        c_ok = co < COUT
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(KH):
            hi = h_o + (kh - PAD_H)
            for kw in tl.static_range(KW):
                wi = w_o + (kw - PAD_W)
                m = ok & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
                row = (frame * H + hi) * W + wi
                col = (kh * KW + kw) * COUT + co
                acc += tl.load(p_ptr + row[:, None] * COLUMNS + col[None, :],
                               mask=m[:, None] & c_ok[None, :], other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + co, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + pix[:, None] * COUT + co[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & c_ok[None, :])


__all__ = [
    "NARROW_CONV",
    "NarrowWeight",
    "narrow_conv",
    "narrow_conv_reference",
    "narrow_conv_unsupported",
    "pack_narrow_conv_weight",
    "prologue_reference",
]
