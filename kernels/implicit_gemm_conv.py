"""Stride-1 convolution of channels-last activations as an implicit GEMM (Triton), bias and
residual add in its epilogue.

The GEMM: rows are output pixels (M = N * T' * H' * W'), columns output channels, and the
reduction runs over every tap and input channel (K = KT * KH * KW * Cin). No im2col buffer is
built: for reduction step ``(tap, c0)`` each row reads ``BLOCK_K`` contiguous channels of the
input pixel under that tap, so a channels-last input makes every A-tile row one contiguous
run. Taps that fall outside the input read zeros (the conv's zero padding, done by masks).
The loop over ``(tap, channel block)`` is one flat loop so Triton pipelines all of it
(``num_stages``), not only the channel blocks of one tap.

Layouts: the input is 4-D (N, C, H, W) or 5-D (N, C, T, H, W) with the channel stride 1 and any
other strides (a frame slice of a channels-last-3d buffer qualifies); the weight is packed once
by ``pack_conv_weight`` to (KT, KH, KW, Cin, Cout), Cout innermost, so a B tile is rows of
contiguous output channels; the output is a new channels-last(-3d) tensor. Pixel offsets are
int64 (a 1024² 128-channel batch of 16 already exceeds 2^31 elements); the row index M is
int32, so M < 2^31 pixels (``MAX_PIXELS``).

Under ``TRITON_INTERPRET=1`` the tiles are widened to fp32 before ``tl.dot`` (the interpreter's
bf16 product is wrong; bf16 values are exact in fp32, so the test oracle is unchanged).

Two variants of the same GEMM (``ConvConfig.tma``): the pointer variant above, for any strides;
and a TMA variant for dense tensors, whose row tile is a rectangle of output pixels loaded by
Hopper's tensor-memory accelerator from 4-D descriptors (frames x rows x columns x channels),
the copy engine's zero fill doing the padding. The per-conv benchmark tries both; on the GPU
the pointer variant was measured (docs/benchmark/convs), the TMA variant only under the
interpreter and in its GPU tests' oracle check.

Rounding: products of bf16/fp16 inputs accumulate in fp32 (the tensor cores' products are
exact), bias and residual are added in fp32 and the sum is rounded once to the activation
dtype; cuDNN rounds its conv output before torch's separate bias and residual adds, so results
differ from stock by about one rounding of the output.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F

from .accepts import Accepts, autograd_reason, channel_stride_one, pow2
from .backend import interpreting, launch, on_device, tl, triton

try:  # host-side tensor descriptors (the TMA variant); Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:
    TensorDescriptor = None

MAX_PIXELS = 2**31  # output pixels over the whole batch (int32 row index)
MAX_TAPS = 27


# What the kernel takes as its input ``x`` (``implicit_gemm_conv_unsupported`` asks this).
IMPLICIT_GEMM_CONV = Accepts(
    min_rank=4, max_rank=5, dtypes=(torch.bfloat16, torch.float16),
    layout=channel_stride_one, layout_reason="channels not innermost",
)


@dataclass(frozen=True)
class ConvConfig:
    """One tiling of the GEMM: output pixels x output channels x reduction step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    # Rows ordered (n, h, w, t): a tile holds every output frame of fewer pixels, so the input
    # frames its temporal taps share are read while still in cache (3-D kernels only).
    time_inner: bool = False
    # Tiles loaded by the tensor-memory accelerator (Hopper's bulk tensor copies): the row
    # tile is a (block_m // tma_width) x tma_width rectangle of output pixels, and the copy
    # engine fills the taps that leave the image with zeros (``tma_reason`` says where).
    tma: bool = False
    tma_width: int = 16

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}"
                f"/w{self.num_warps}/s{self.num_stages}" + ("/t" if self.time_inner else "")
                + (f"/tma{self.tma_width}" if self.tma else ""))


def default_config(cin: int, cout: int) -> ConvConfig:
    """A tiling that fits the channel counts: channel blocks that divide them where they can
    (96 channels as three 32-blocks, not a 64-block half masked), narrow N for narrow outputs."""
    block_k = 64 if cin % 64 == 0 else (32 if cin % 32 == 0 else min(64, max(16, pow2(cin))))
    block_n = min(128, max(16, pow2(cout)))
    if cout % 128 and cout % 64 == 0:
        block_n = 64
    if block_n == 128:
        return ConvConfig(128, 128, block_k, 8, 3)
    return ConvConfig(128, block_n, block_k, 4, 4)


# The tilings the per-conv benchmark tries (besides ``default_config``'s pick).
SWEEP_CONFIGS = (
    ConvConfig(128, 128, 64, 8, 3),
    ConvConfig(128, 256, 64, 8, 3),
    ConvConfig(256, 128, 64, 8, 3),
    ConvConfig(128, 64, 64, 4, 4),
    ConvConfig(64, 128, 64, 4, 4),
    ConvConfig(256, 16, 64, 8, 3),  # narrow outputs (heads): more pixels per program
    ConvConfig(64, 16, 64, 4, 4),
    ConvConfig(128, 256, 64, 8, 3, time_inner=True),  # 3-D inputs of several output frames
    ConvConfig(128, 128, 64, 8, 3, tma=True),
    ConvConfig(128, 256, 64, 8, 3, tma=True),
    ConvConfig(256, 128, 64, 8, 3, tma=True),
    ConvConfig(128, 128, 32, 4, 4, tma=True),
)

# The tilings the per-conv benchmark tries for ``narrow_conv``'s tap products (few columns,
# a short reduction: memory-bound, so wide row tiles and deep pipelines; block_n is capped at
# the columns there).
NARROW_SWEEP_CONFIGS = (
    ConvConfig(128, 32, 64, 4, 3),
    ConvConfig(256, 32, 64, 8, 3),
    ConvConfig(128, 32, 32, 4, 4),
    ConvConfig(256, 128, 32, 8, 3),
    ConvConfig(128, 32, 32, 4, 4, time_inner=True),
    ConvConfig(256, 128, 32, 8, 3, time_inner=True),
)


def pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, (KT,) KH, KW] conv weight -> [KT, KH, KW, Cin, Cout] contiguous (KT = 1 for
    a 2-D conv): the B operand, Cout innermost."""
    if weight.dim() == 4:
        weight = weight.unsqueeze(2)
    if weight.dim() != 5:
        raise ValueError(f"expected a 2-D or 3-D conv weight, got shape {tuple(weight.shape)}")
    return weight.permute(2, 3, 4, 1, 0).contiguous()


def _as_5d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(2) if x.dim() == 4 else x


def _pads(padding, rank: int) -> tuple[int, int, int]:
    pad = (padding,) * (rank - 2) if isinstance(padding, int) else tuple(padding)
    return (0, *pad) if rank == 4 else pad


def output_shape(x_shape, packed_shape, padding) -> tuple[int, ...]:
    """The conv's output shape for input ``x_shape`` (4-D or 5-D)."""
    kt, kh, kw, _, cout = packed_shape
    pt, ph, pw = _pads(padding, len(x_shape))
    n, _, *spatial = x_shape
    t, h, w = ([1] + list(spatial)) if len(x_shape) == 4 else spatial
    dims = (t + 2 * pt - kt + 1, h + 2 * ph - kh + 1, w + 2 * pw - kw + 1)
    return (n, cout, *dims[1:]) if len(x_shape) == 4 else (n, cout, *dims)


def implicit_gemm_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 padding=1, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The test oracle: the conv of ``x`` with the stock ``weight`` ([Cout, Cin, *k]) in fp32,
    then ``+ bias (+ residual)`` in fp32, rounded once to ``x.dtype``, channels-last."""
    conv = F.conv2d if x.dim() == 4 else F.conv3d
    y = conv(x.float(), weight.float(), None, padding=padding)
    if bias is not None:
        y = y + bias.float().reshape((1, -1) + (1,) * (x.dim() - 2))
    if residual is not None:
        y = y + residual.float()
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return y.to(x.dtype).contiguous(memory_format=fmt)


def implicit_gemm_conv_unsupported(x: torch.Tensor, packed: torch.Tensor, padding=1,
                                   bias: torch.Tensor | None = None,
                                   residual: torch.Tensor | None = None) -> str | None:
    """Why ``implicit_gemm_conv`` cannot take these tensors (short, for the log); None if it can."""
    reason = IMPLICIT_GEMM_CONV.tensor_reason(x)
    if reason is not None:
        return reason
    if packed.dim() != 5 or not packed.is_contiguous():
        return "weight not packed by pack_conv_weight"
    kt, kh, kw, cin, cout = packed.shape
    if x.dim() == 4 and kt != 1:
        return "a 3-D weight for a 4-D input"
    if cin != x.shape[1]:
        return f"weight takes {cin} channels, input has {x.shape[1]}"
    if packed.dtype != x.dtype or packed.device != x.device:
        return "weight differs from the input in dtype or device"
    if kt * kh * kw > MAX_TAPS:
        return f"{kt}x{kh}x{kw} kernel (at most {MAX_TAPS} taps)"
    pads = _pads(padding, x.dim())
    if len(pads) != 3 or any(p < 0 for p in pads):
        return f"padding {padding}"
    shape = output_shape(x.shape, packed.shape, padding)
    if any(s <= 0 for s in shape[2:]):
        return "kernel larger than the padded input"
    if prod(shape) // cout >= MAX_PIXELS:
        return "2^31 or more output pixels"
    if bias is not None and (bias.numel() != cout or bias.device != x.device
                             or not bias.is_floating_point()):
        return "bias does not match the output's channels/device"
    if residual is not None and (tuple(residual.shape) != shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not channel_stride_one(residual)):
        return "residual differs from the output in shape, dtype, device or layout"
    return autograd_reason(x, packed, bias, residual)


def tma_reason(x: torch.Tensor, packed: torch.Tensor, padding, out_dtype: torch.dtype,
               residual: torch.Tensor | None, cfg: ConvConfig) -> str | None:
    """Why the TMA variant cannot take a call ``implicit_gemm_conv`` accepted (it then runs
    the pointer variant): the copy engine needs dense channels-last(-3d) tensors (frames are
    flattened into one axis, so no time padding), 16-byte aligned rows and bases, and tiles
    of whole rows of ``tma_width`` pixels."""
    if TensorDescriptor is None:
        return "no tensor descriptors in this Triton"
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if not x.is_contiguous(memory_format=fmt):
        return "input not dense channels-last"
    if residual is not None and not residual.is_contiguous(memory_format=fmt):
        return "residual not dense channels-last"
    if _pads(padding, x.dim())[0] != 0:
        return "time padding"
    cin, cout = packed.shape[3:]
    if (cin * x.element_size()) % 16 or (cout * torch.finfo(out_dtype).bits // 8) % 16:
        return "channel rows not 16-byte multiples"
    if any(t.data_ptr() % 16 for t in (x, packed) + ((residual,) if residual is not None else ())):
        return "base not 16-byte aligned"
    if cfg.block_m % cfg.tma_width:
        return "row tile not whole rows"
    return None


def implicit_gemm_conv(x: torch.Tensor, packed: torch.Tensor, padding=1,
                       bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                       config: ConvConfig | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``conv(x, weight, padding) + bias (+ residual)`` for the weight ``packed`` by
    ``pack_conv_weight``, stride 1; a new channels-last(-3d) tensor in ``out_dtype`` (default
    ``x``'s; fp32 keeps the accumulator unrounded for a later sum), or None when unsupported
    (``implicit_gemm_conv_unsupported`` says why)."""
    if implicit_gemm_conv_unsupported(x, packed, padding, bias, residual) is not None:
        return None
    if residual is not None and out_dtype not in (None, x.dtype):
        return None
    kt, kh, kw, cin, cout = packed.shape
    shape = output_shape(x.shape, packed.shape, padding)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    out = torch.empty(shape, dtype=out_dtype or x.dtype, device=x.device, memory_format=fmt)
    x5, out5 = _as_5d(x), _as_5d(out)
    res5 = _as_5d(residual) if residual is not None else out5  # unread without HAS_RES
    pt, ph, pw = _pads(padding, x.dim())
    cfg = config or default_config(cin, cout)
    if cfg.tma and tma_reason(x, packed, padding, out.dtype, residual, cfg) is None:
        _launch_tma(x5, packed, bias, residual, out5, ph, pw, cfg)
        return out
    n, _, t_out, h_out, w_out = out5.shape
    m = n * t_out * h_out * w_out
    tiles_m = -(-m // cfg.block_m)
    tiles_n = -(-cout // cfg.block_n)
    sx = [x5.stride(d) for d in (0, 2, 3, 4)]
    so = [out5.stride(d) for d in (0, 2, 3, 4)]
    sr = [res5.stride(d) for d in (0, 2, 3, 4)]
    with on_device(x.device):
        launch(_implicit_gemm_conv_kernel, (tiles_m * tiles_n,),
            x5, packed, bias if bias is not None else packed, res5, out5,
            m, t_out, h_out, w_out, x5.shape[2], x5.shape[3], x5.shape[4], cin, cout,
            *sx, *so, *sr,
            KT=kt, KH=kh, KW=kw, PAD_T=pt, PAD_H=ph, PAD_W=pw,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            TIME_INNER=cfg.time_inner and t_out > 1,
            EVEN_K=cin % cfg.block_k == 0, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, DOT_FP32=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


_TL_DTYPES = {} if tl is None else {
    torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _frames_desc(t5: torch.Tensor, block: list[int]):
    """(N, C, T, H, W) dense channels-last-3d as a 4-D (N * T, H, W, C) tensor descriptor."""
    n, c, t, h, w = t5.shape
    return TensorDescriptor(t5, [n * t, h, w, c], [h * w * c, w * c, c, 1], block)


def _launch_tma(x5, packed, bias, residual, out5, ph, pw, cfg: ConvConfig) -> None:
    kt, kh, kw, cin, cout = packed.shape
    n, _, t_out, h_out, w_out = out5.shape
    bh, bw = cfg.block_m // cfg.tma_width, cfg.tma_width
    x_desc = _frames_desc(x5, [1, bh, bw, cfg.block_k])
    w_desc = TensorDescriptor(packed, [kt * kh * kw * cin, cout], [cout, 1],
                              [cfg.block_k, cfg.block_n])
    o_desc = _frames_desc(out5, [1, bh, bw, cfg.block_n])
    r_desc = _frames_desc(_as_5d(residual), [1, bh, bw, cfg.block_n]) if residual is not None \
        else o_desc
    tiles_h, tiles_w = -(-h_out // bh), -(-w_out // bw)
    tiles_n = -(-cout // cfg.block_n)
    with on_device(x5.device):
        launch(_implicit_gemm_conv_tma_kernel, (n * t_out * tiles_h * tiles_w * tiles_n,),
            x_desc, w_desc, bias if bias is not None else packed, r_desc, o_desc,
            t_out, x5.shape[2], tiles_h, tiles_w, cin, cout,
            KT=kt, KH=kh, KW=kw, PAD_H=ph, PAD_W=pw, BH=bh, BW=bw,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, DOT_FP32=interpreting(),
            OUT_DTYPE=_TL_DTYPES[out5.dtype],
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


if triton is not None:

    @triton.jit
    def _reduction_step(it, k_chunks, KH: tl.constexpr, KW: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """Reduction step ``it`` -> (tap, first channel, temporal, row and column offset)."""
        tap = it // k_chunks
        c0 = (it - tap * k_chunks) * BLOCK_K
        return tap, c0, tap // (KH * KW), (tap // KW) % KH, tap % KW

    @triton.jit(do_not_specialize=["T_OUT", "T_IN", "TILES_H", "TILES_W"])
    def _implicit_gemm_conv_tma_kernel(
        x_desc, w_desc, bias_ptr, r_desc, o_desc, T_OUT, T_IN, TILES_H, TILES_W, CIN, COUT,
        KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        PAD_H: tl.constexpr, PAD_W: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
    ):
        # Column tiles innermost: the programs sharing an input rectangle run together.
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(COUT, BLOCK_N)
        pid_n = pid % tiles_n
        r = pid // tiles_n
        w0 = (r % TILES_W) * BW
        r = r // TILES_W
        h0 = (r % TILES_H) * BH
        frame = r // TILES_H  # n * T_OUT + t
        first_in = (frame // T_OUT) * T_IN + frame % T_OUT
        n0 = pid_n * BLOCK_N
        k_chunks = tl.cdiv(CIN, BLOCK_K)
        acc = tl.zeros((BH * BW, BLOCK_N), dtype=tl.float32)
        for it in range(0, KT * KH * KW * k_chunks):
            tap, c0, dt, dh, dw = _reduction_step(it, k_chunks, KH, KW, BLOCK_K)
            # Out-of-image taps (negative or past the edge) and channels past CIN arrive as
            # zeros; the weight rows they meet belong to the next tap and add nothing.
            a = x_desc.load([first_in + dt, h0 + dh - PAD_H, w0 + dw - PAD_W, c0])
            a = a.reshape(BH * BW, BLOCK_K)
            b = w_desc.load([tap * CIN + c0, n0])
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            cols = n0 + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + cols, mask=cols < COUT, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += r_desc.load([frame, h0, w0, n0]).reshape(BH * BW, BLOCK_N).to(tl.float32)
        o_desc.store([frame, h0, w0, n0],
                     acc.to(OUT_DTYPE).reshape(1, BH, BW, BLOCK_N))

    @triton.jit(do_not_specialize=["M", "T_OUT", "H_OUT", "W_OUT", "T_IN", "H_IN", "W_IN"])
    def _implicit_gemm_conv_kernel(
        x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
        M, T_OUT, H_OUT, W_OUT, T_IN, H_IN, W_IN, CIN, COUT,
        sxn, sxt, sxh, sxw, son, sot, soh, sow, srn, srt, srh, srw,
        KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        PAD_T: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, TIME_INNER: tl.constexpr, EVEN_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        # Grouped tile order: GROUP_M row tiles share each weight column tile while it is in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(COUT, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        if TIME_INNER:
            t_o = rows % T_OUT
            r = rows // T_OUT
            w_o = r % W_OUT
            r = r // W_OUT
            h_o = r % H_OUT
            n_o = r // H_OUT
        else:
            w_o = rows % W_OUT
            r = rows // W_OUT
            h_o = r % H_OUT
            r = r // H_OUT
            t_o = r % T_OUT
            n_o = r // T_OUT
        # Input offset of each row's pixel at tap (0, 0, 0) minus the padding, in int64; a tap
        # adds a scalar delta. Rows whose tap leaves the input are masked (zero padding).
        base = (n_o.to(tl.int64) * sxn + (t_o - PAD_T).to(tl.int64) * sxt
                + (h_o - PAD_H).to(tl.int64) * sxh + (w_o - PAD_W).to(tl.int64) * sxw)

        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < COUT
        ks = tl.arange(0, BLOCK_K)
        k_chunks = tl.cdiv(CIN, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(0, KT * KH * KW * k_chunks):
            tap, c0, dt, dh, dw = _reduction_step(it, k_chunks, KH, KW, BLOCK_K)
            ti = t_o + (dt - PAD_T)
            hi = h_o + (dh - PAD_H)
            wi = w_o + (dw - PAD_W)
            ok = (row_ok & (ti >= 0) & (ti < T_IN) & (hi >= 0) & (hi < H_IN)
                  & (wi >= 0) & (wi < W_IN))
            delta = dt.to(tl.int64) * sxt + dh.to(tl.int64) * sxh + dw.to(tl.int64) * sxw
            a_ptrs = x_ptr + (base + delta)[:, None] + (c0 + ks)[None, :]
            b_ptrs = w_ptr + (tap * CIN + c0 + ks)[:, None] * COUT + cols[None, :]
            if EVEN_K:
                a = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (c0 + ks) < CIN
                a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        n64 = n_o.to(tl.int64)
        t64 = t_o.to(tl.int64)
        h64 = h_o.to(tl.int64)
        w64 = w_o.to(tl.int64)
        if HAS_RES:
            r_off = n64 * srn + t64 * srt + h64 * srh + w64 * srw
            acc += tl.load(res_ptr + r_off[:, None] + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        o_off = n64 * son + t64 * sot + h64 * soh + w64 * sow
        tl.store(out_ptr + o_off[:, None] + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


__all__ = [
    "IMPLICIT_GEMM_CONV",
    "NARROW_SWEEP_CONFIGS",
    "SWEEP_CONFIGS",
    "ConvConfig",
    "default_config",
    "implicit_gemm_conv",
    "implicit_gemm_conv_reference",
    "implicit_gemm_conv_unsupported",
    "output_shape",
    "pack_conv_weight",
]
