"""3x3 stride-1 pad-1 convolution by Winograd F(4x4, 3x3) on channels-last tensors.

A direct 3x3 convolution spends 9 multiply-adds per output pixel, input channel and output
channel; F(4x4, 3x3) spends 36 per 4x4 output tile, 2.25 per pixel: 4x fewer. The price is
memory: each 6x6 input patch (overlapping its neighbours by 2) becomes 36 transformed values
per channel (``V``, 2.25x the input), 36 batched matrix products (cuBLAS) give 36 values per
tile and output channel (``M``), and 16 outputs come back out of them. It pays where channels
are many (the matrix products dominate): SDXL's 512- and 256-channel stages, where cuDNN's
direct convolution is already near the tensor cores' rate and nothing but fewer FLOPs is left.

Accuracy (CPU, float64 sums, against the fp32 conv of fp32 SiLU'd activations with weights of
std 1/sqrt(9 Cin), every output rounded to bf16; 64-512 channels, one conv):
- bf16 direct conv (bf16 input and weight): 63.5-65.4 dB;
- V and U in fp16, M in fp32, from the same bf16 input: 60.8-62.7 dB (about 1.4x the direct
  conv's RMS error); from the fp32 input (a transform fused behind the norm): 61.6-63.6 dB;
  M in fp16 instead costs about 1 dB more;
- V and U in bf16: 46.8-47.9 dB (the transform's coefficients, up to 5 and 25 after both
  sides, cost bf16's 8 bits too much): so fp16, never bf16, for the products' inputs;
- F(2x2, 3x3) (2.25x fewer products, not 4x) with fp16 V matches the direct conv (63.4-65.3).

fp16's range is the risk bf16 does not have: V's entries are sums of up to 100 times an input
(|B^T|'s rows sum to at most 10, on both sides), so inputs past about 650 overflow to inf. The
only caller (``kl.ops.resnet_conv``, behind an off-by-default setting) feeds it GroupNorm +
SiLU outputs, which stay far below that unless a norm's weight is in the hundreds; nothing
checks it per call.

Matrices (points 0, 1, -1, 2, -2 and infinity; Lavin and Gray's F(4x4, 3x3)):
``V = B^T d B`` per 6x6 patch ``d``, ``U = G g G^T`` per 3x3 filter ``g`` (once per weight,
float64 then fp16), ``Y = A^T M A`` per tile, with ``M = U . V`` summed over input channels.

Layouts: ``V`` is [36, T, Cin] and ``U`` [36, Cin, Cout], so each of the 36 products is a plain
row-major GEMM (T = N * ceil(H/4) * ceil(W/4) tiles); ``M`` is [36, T, Cout]. The input and
output kernels read and write channels-last pixels, contiguous along C. Offsets into V and M
are int64: 36 * T * C passes 2^31 at 128 channels of 4096².
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .accepts import Accepts, autograd_reason, channels_last_4d
from .backend import launch, on_device, tl, triton

# [36, Cin, Cout] fp16 products; float64 sums of the transforms before the one rounding.
_BT = ((4, 0, -5, 0, 1, 0),
       (0, -4, -4, 1, 1, 0),
       (0, 4, -4, -1, 1, 0),
       (0, -2, -1, 2, 1, 0),
       (0, 2, -1, -2, 1, 0),
       (0, 4, 0, -5, 0, 1))
_G = ((1 / 4, 0, 0),
      (-1 / 6, -1 / 6, -1 / 6),
      (-1 / 6, 1 / 6, -1 / 6),
      (1 / 24, 1 / 12, 1 / 6),
      (1 / 24, -1 / 12, 1 / 6),
      (0, 0, 1))
_AT = ((1, 1, 1, 1, 1, 0),
       (0, 1, -1, 2, -2, 0),
       (0, 1, 1, 4, 4, 0),
       (0, 1, -1, 8, -8, 1))

TILE = 4  # output pixels per tile side
PATCH = 6  # input pixels per patch side
PRODUCT_DTYPE = torch.float16

WINOGRAD_CONV = Accepts(min_rank=4, max_rank=4, dtypes=(torch.bfloat16, torch.float16),
                        layout=channels_last_4d)


def _mat(rows, dtype=torch.float64, device=None) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype, device=device)


def tile_grid(h: int, w: int) -> tuple[int, int]:
    return -(-h // TILE), -(-w // TILE)


def winograd_weight(weight: torch.Tensor) -> torch.Tensor:
    """``U = G g G^T`` of a [Cout, Cin, 3, 3] weight as [36, Cin, Cout] fp16 (float64 math, one
    rounding). Callers cache it per weight version."""
    g = _mat(_G, device=weight.device)
    u = torch.einsum("ij,ocjk,lk->ilco", g, weight.detach().double(), g)
    return u.reshape(PATCH * PATCH, weight.shape[1], weight.shape[0]).to(PRODUCT_DTYPE).contiguous()


def winograd_input_reference(x: torch.Tensor) -> torch.Tensor:
    """``V`` [36, T, C] (fp16) of a [N, C, H, W] tensor: the Triton kernel's oracle."""
    n, c, h, w = x.shape
    th, tw = tile_grid(h, w)
    pad_h, pad_w = th * TILE + 2 - h - 1, tw * TILE + 2 - w - 1
    xp = torch.nn.functional.pad(x.float(), (1, pad_w, 1, pad_h))
    d = xp.unfold(2, PATCH, TILE).unfold(3, PATCH, TILE)  # N C TH TW 6 6
    bt = _mat(_BT, torch.float32, x.device)
    v = torch.einsum("ij,nchwjk,lk->ilnhwc", bt, d, bt)
    return v.reshape(PATCH * PATCH, n * th * tw, c).to(PRODUCT_DTYPE)


def winograd_output_reference(m: torch.Tensor, shape: tuple[int, int, int], bias: torch.Tensor | None,
                              dtype: torch.dtype) -> torch.Tensor:
    """``Y = A^T M A`` (+ bias) of an [36, T, Cout] ``M`` as an [N, Cout, H, W] channels-last
    tensor of ``dtype``: the Triton kernel's oracle."""
    n, h, w = shape
    th, tw = tile_grid(h, w)
    cout = m.shape[-1]
    at = _mat(_AT, torch.float32, m.device)
    mm = m.float().reshape(PATCH, PATCH, n, th, tw, cout)
    y = torch.einsum("ij,jknhwc,lk->nhiwlc", at, mm, at).reshape(n, th * TILE, tw * TILE, cout)
    y = y[:, :h, :w]
    if bias is not None:
        y = y + bias.float()
    return y.permute(0, 3, 1, 2).to(dtype)


def winograd_conv_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The whole convolution in plain torch, with the kernel's roundings (fp16 V and U, M in
    fp32): the oracle of ``winograd_conv``."""
    v = winograd_input_reference(x).float()
    m = torch.bmm(v, winograd_weight(weight).float())
    n, _, h, w = x.shape
    return winograd_output_reference(m, (n, h, w), bias, x.dtype)


def winograd_conv_unsupported(x: torch.Tensor, u: torch.Tensor | None = None) -> str | None:
    """Why ``winograd_conv`` cannot take ``x`` (and the transformed weight ``u``, if given);
    None if it can. Without ``u``, a caller can ask before it transforms a weight."""
    reason = WINOGRAD_CONV.tensor_reason(x) or autograd_reason(x)
    if reason is not None or u is None:
        return reason
    if u.shape[:2] != (PATCH * PATCH, x.shape[1]) or u.dtype != PRODUCT_DTYPE:
        return f"transformed weight {tuple(u.shape)} {u.dtype} does not fit {x.shape[1]} channels"
    return None


_FP32_OUT = {"bmm": True}


def _matmul_fp32(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[36, T, Cin] x [36, Cin, Cout] with fp32 outputs (cuBLAS accumulates in fp32 either way;
    keeping M in fp32 is worth 1.1 dB per conv over rounding it to fp16)."""
    if v.is_cuda and _FP32_OUT["bmm"]:
        try:
            return torch.bmm(v, u, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without bmm's out_dtype
            _FP32_OUT["bmm"] = False
    # The same sums from widened inputs (fp16 is exact in fp32): the interpreter's CPU tensors,
    # and older torch, at twice the products' traffic.
    return torch.bmm(v.float(), u.float())


class WinogradLaunch(NamedTuple):
    """Tile of the input or output kernel: BLOCK_T tiles x BLOCK_C channels per program."""

    block_t: int = 8
    block_c: int = 64
    num_warps: int = 4

    def __str__(self) -> str:
        return f"{self.block_t}x{self.block_c}/w{self.num_warps}"


class WinogradLaunches(NamedTuple):
    """The input kernel's tiling and the output kernel's."""

    input: WinogradLaunch
    output: WinogradLaunch

    def __str__(self) -> str:
        return f"in {self.input} out {self.output}"


# The fastest of five tilings at every KL shape, 128-512 channels (s41's probe, H100):
# 4 tiles x 64 channels for the input; 8 x 64 (16 x 64 / 8 warps within 5%) for the output.
LAUNCHES = WinogradLaunches(WinogradLaunch(4, 64, 4), WinogradLaunch(8, 64, 4))
# The tilings the per-conv benchmark's sweep adds.
SWEEP_LAUNCHES = (WinogradLaunches(WinogradLaunch(4, 64, 4), WinogradLaunch(16, 64, 8)),
                  WinogradLaunches(WinogradLaunch(8, 32, 4), WinogradLaunch(8, 32, 4)))


def winograd_input(x: torch.Tensor, launch_cfg: WinogradLaunch | None = None) -> torch.Tensor:
    """``V`` [36, T, C] fp16 of channels-last ``x`` (Triton; ``winograd_input_reference``);
    ``LAUNCHES.input``'s tiling unless given."""
    launch_cfg = launch_cfg or LAUNCHES.input
    n, c, h, w = x.shape
    th, tw = tile_grid(h, w)
    tiles = n * th * tw
    v = torch.empty((PATCH * PATCH, tiles, c), device=x.device, dtype=PRODUCT_DTYPE)
    block_c = min(launch_cfg.block_c, triton.next_power_of_2(c))
    with on_device(x.device):
        launch(_winograd_input_kernel, (triton.cdiv(tiles, launch_cfg.block_t), triton.cdiv(c, block_c)),
               x, v, c, h, w, th, tw, tiles, x.stride(0), x.stride(2), x.stride(3),
               BLOCK_T=launch_cfg.block_t, BLOCK_C=block_c, num_warps=launch_cfg.num_warps)
    return v


def winograd_output(m: torch.Tensor, shape: tuple[int, int, int], bias: torch.Tensor | None,
                    dtype: torch.dtype, launch_cfg: WinogradLaunch | None = None) -> torch.Tensor:
    """``Y = A^T M A`` (+ bias), channels-last [N, Cout, H, W] of ``dtype`` (Triton;
    ``winograd_output_reference``); ``LAUNCHES.output``'s tiling unless given."""
    launch_cfg = launch_cfg or LAUNCHES.output
    n, h, w = shape
    th, tw = tile_grid(h, w)
    tiles = n * th * tw
    cout = m.shape[2]
    y = torch.empty((n, cout, h, w), device=m.device, dtype=dtype, memory_format=torch.channels_last)
    block_c = min(launch_cfg.block_c, triton.next_power_of_2(cout))
    with on_device(m.device):
        launch(_winograd_output_kernel, (triton.cdiv(tiles, launch_cfg.block_t), triton.cdiv(cout, block_c)),
               m, y, bias if bias is not None else m, cout, h, w, th, tw, tiles,
               y.stride(0), y.stride(2), y.stride(3),
               HAS_BIAS=bias is not None, BLOCK_T=launch_cfg.block_t, BLOCK_C=block_c,
               num_warps=launch_cfg.num_warps)
    return y


def winograd_conv(x: torch.Tensor, u: torch.Tensor, bias: torch.Tensor | None = None,
                  launches: WinogradLaunches = LAUNCHES) -> torch.Tensor:
    """3x3 / stride 1 / padding 1 convolution of channels-last ``x`` with the transformed
    weight ``u`` (``winograd_weight``), plus ``bias``; channels-last output of x's dtype."""
    n, _, h, w = x.shape
    m = _matmul_fp32(winograd_input(x, launches.input), u)
    return winograd_output(m, (n, h, w), bias, x.dtype, launches.output)


if triton is not None:

    @triton.jit
    def _bt6(d0, d1, d2, d3, d4, d5):
        # B^T applied along one side of the patch.
        return (4.0 * d0 - 5.0 * d2 + d4,
                -4.0 * (d1 + d2) + d3 + d4,
                4.0 * (d1 - d2) - d3 + d4,
                2.0 * (d3 - d1) - d2 + d4,
                2.0 * (d1 - d3) - d2 + d4,
                4.0 * d1 - 5.0 * d3 + d5)

    @triton.jit
    def _at6(m0, m1, m2, m3, m4, m5):
        # A^T applied along one side of the tile.
        a = m1 + m2
        b = m1 - m2
        c = m3 + m4
        e = m3 - m4
        return a + c + m0, b + 2.0 * e, a + 4.0 * c, b + 8.0 * e + m5

    @triton.jit
    def _patch_row(x_ptr, base, row, col0, c_off, h, w, tmask, cmask, sh, sw):
        # One patch row (6 pixels) of BLOCK_T tiles, zero outside the image (the conv's padding),
        # times B: a row of E = d B.
        rmask = tmask & (row >= 0) & (row < h)
        p = x_ptr + (base + row * sh)[:, None] + c_off[None, :]
        m0 = (rmask & (col0 >= 0))[:, None] & cmask[None, :]
        m1 = (rmask & (col0 + 1 < w))[:, None] & cmask[None, :]
        m2 = (rmask & (col0 + 2 < w))[:, None] & cmask[None, :]
        m3 = (rmask & (col0 + 3 < w))[:, None] & cmask[None, :]
        m4 = (rmask & (col0 + 4 < w))[:, None] & cmask[None, :]
        m5 = (rmask & (col0 + 5 < w))[:, None] & cmask[None, :]
        d0 = tl.load(p + (col0 * sw)[:, None], mask=m0, other=0.0).to(tl.float32)
        d1 = tl.load(p + ((col0 + 1) * sw)[:, None], mask=m1, other=0.0).to(tl.float32)
        d2 = tl.load(p + ((col0 + 2) * sw)[:, None], mask=m2, other=0.0).to(tl.float32)
        d3 = tl.load(p + ((col0 + 3) * sw)[:, None], mask=m3, other=0.0).to(tl.float32)
        d4 = tl.load(p + ((col0 + 4) * sw)[:, None], mask=m4, other=0.0).to(tl.float32)
        d5 = tl.load(p + ((col0 + 5) * sw)[:, None], mask=m5, other=0.0).to(tl.float32)
        return _bt6(d0, d1, d2, d3, d4, d5)

    @triton.jit
    def _store_v_column(v_ptr, plane, rowoff, smask, J: tl.constexpr, e0, e1, e2, e3, e4, e5):
        # Column J of V = B^T E: entries (k, J) for k = 0..5.
        v0, v1, v2, v3, v4, v5 = _bt6(e0, e1, e2, e3, e4, e5)
        ty = v_ptr.dtype.element_ty
        tl.store(v_ptr + (0 * 6 + J) * plane + rowoff, v0.to(ty), mask=smask)
        tl.store(v_ptr + (1 * 6 + J) * plane + rowoff, v1.to(ty), mask=smask)
        tl.store(v_ptr + (2 * 6 + J) * plane + rowoff, v2.to(ty), mask=smask)
        tl.store(v_ptr + (3 * 6 + J) * plane + rowoff, v3.to(ty), mask=smask)
        tl.store(v_ptr + (4 * 6 + J) * plane + rowoff, v4.to(ty), mask=smask)
        tl.store(v_ptr + (5 * 6 + J) * plane + rowoff, v5.to(ty), mask=smask)

    @triton.jit
    def _winograd_input_kernel(x_ptr, v_ptr, C, H, W, TH, TW, T, sn, sh, sw,
                               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_off = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = t < T
        cmask = c_off < C
        tw_i = t % TW
        th_i = (t // TW) % TH
        n_i = t // (TW * TH)
        base = n_i.to(tl.int64) * sn
        row0 = th_i * 4 - 1
        col0 = tw_i * 4 - 1
        a0, a1, a2, a3, a4, a5 = _patch_row(x_ptr, base, row0, col0, c_off, H, W, tmask, cmask, sh, sw)
        b0, b1, b2, b3, b4, b5 = _patch_row(x_ptr, base, row0 + 1, col0, c_off, H, W, tmask, cmask, sh, sw)
        c0, c1, c2, c3, c4, c5 = _patch_row(x_ptr, base, row0 + 2, col0, c_off, H, W, tmask, cmask, sh, sw)
        d0, d1, d2, d3, d4, d5 = _patch_row(x_ptr, base, row0 + 3, col0, c_off, H, W, tmask, cmask, sh, sw)
        f0, f1, f2, f3, f4, f5 = _patch_row(x_ptr, base, row0 + 4, col0, c_off, H, W, tmask, cmask, sh, sw)
        g0, g1, g2, g3, g4, g5 = _patch_row(x_ptr, base, row0 + 5, col0, c_off, H, W, tmask, cmask, sh, sw)
        smask = tmask[:, None] & cmask[None, :]
        plane = T.to(tl.int64) * C
        rowoff = t.to(tl.int64)[:, None] * C + c_off[None, :]
        _store_v_column(v_ptr, plane, rowoff, smask, 0, a0, b0, c0, d0, f0, g0)
        _store_v_column(v_ptr, plane, rowoff, smask, 1, a1, b1, c1, d1, f1, g1)
        _store_v_column(v_ptr, plane, rowoff, smask, 2, a2, b2, c2, d2, f2, g2)
        _store_v_column(v_ptr, plane, rowoff, smask, 3, a3, b3, c3, d3, f3, g3)
        _store_v_column(v_ptr, plane, rowoff, smask, 4, a4, b4, c4, d4, f4, g4)
        _store_v_column(v_ptr, plane, rowoff, smask, 5, a5, b5, c5, d5, f5, g5)

    @triton.jit
    def _s_column(m_ptr, plane, rowoff, lmask, J: tl.constexpr):
        # Column J of S = A^T M: entries (k, J) for k = 0..3.
        m0 = tl.load(m_ptr + (0 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        m1 = tl.load(m_ptr + (1 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        m2 = tl.load(m_ptr + (2 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        m3 = tl.load(m_ptr + (3 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        m4 = tl.load(m_ptr + (4 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        m5 = tl.load(m_ptr + (5 * 6 + J) * plane + rowoff, mask=lmask, other=0.0).to(tl.float32)
        return _at6(m0, m1, m2, m3, m4, m5)

    @triton.jit
    def _store_y_row(base, row, col0, h, w, lmask, sh, sw, b, s0, s1, s2, s3, s4, s5):
        # Row ``row`` of the tile, Y = S A, plus the bias.
        y0, y1, y2, y3 = _at6(s0, s1, s2, s3, s4, s5)
        ty = base.dtype.element_ty
        rm = lmask & (row < h)[:, None]
        p = base + (row * sh)[:, None]
        tl.store(p + (col0 * sw)[:, None], (y0 + b).to(ty), mask=rm & (col0 < w)[:, None])
        tl.store(p + ((col0 + 1) * sw)[:, None], (y1 + b).to(ty), mask=rm & (col0 + 1 < w)[:, None])
        tl.store(p + ((col0 + 2) * sw)[:, None], (y2 + b).to(ty), mask=rm & (col0 + 2 < w)[:, None])
        tl.store(p + ((col0 + 3) * sw)[:, None], (y3 + b).to(ty), mask=rm & (col0 + 3 < w)[:, None])

    @triton.jit
    def _winograd_output_kernel(m_ptr, y_ptr, bias_ptr, C, H, W, TH, TW, T, sn, sh, sw,
                                HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_off = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = t < T
        cmask = c_off < C
        lmask = tmask[:, None] & cmask[None, :]
        plane = T.to(tl.int64) * C
        rowoff = t.to(tl.int64)[:, None] * C + c_off[None, :]
        a0, a1, a2, a3 = _s_column(m_ptr, plane, rowoff, lmask, 0)
        b0, b1, b2, b3 = _s_column(m_ptr, plane, rowoff, lmask, 1)
        c0, c1, c2, c3 = _s_column(m_ptr, plane, rowoff, lmask, 2)
        d0, d1, d2, d3 = _s_column(m_ptr, plane, rowoff, lmask, 3)
        f0, f1, f2, f3 = _s_column(m_ptr, plane, rowoff, lmask, 4)
        g0, g1, g2, g3 = _s_column(m_ptr, plane, rowoff, lmask, 5)
        if HAS_BIAS:
            b = tl.load(bias_ptr + c_off, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            b = tl.zeros((1, BLOCK_C), tl.float32)
        tw_i = t % TW
        th_i = (t // TW) % TH
        n_i = t // (TW * TH)
        base = y_ptr + n_i.to(tl.int64)[:, None] * sn + c_off[None, :]
        row0 = th_i * 4
        col0 = tw_i * 4
        _store_y_row(base, row0, col0, H, W, lmask, sh, sw, b, a0, b0, c0, d0, f0, g0)
        _store_y_row(base, row0 + 1, col0, H, W, lmask, sh, sw, b, a1, b1, c1, d1, f1, g1)
        _store_y_row(base, row0 + 2, col0, H, W, lmask, sh, sw, b, a2, b2, c2, d2, f2, g2)
        _store_y_row(base, row0 + 3, col0, H, W, lmask, sh, sw, b, a3, b3, c3, d3, f3, g3)
