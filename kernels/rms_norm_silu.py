"""RMS norm over channels (+ optional SiLU) on channels-last tensors: Wan VAE's ``RMS_norm``
and LTX VAE's ``PixelNorm``.

Math, C = ``x.shape[1]``, ``gamma`` optional (None: 1):

    Wan ``RMS_norm`` (ComfyUI ``comfy.ldm.wan.vae``, diffusers ``WanRMS_norm``):
        y = x / max(||x||_2 over C, eps) * sqrt(C) * gamma + bias
    LTX ``PixelNorm`` (``mean_eps=True``: eps is added to the mean square under the root):
        y = x / sqrt(mean(x^2 over C) + eps) * gamma + bias
    out = silu(y) when ``silu``

The two norms differ only in where eps enters, so they are one operation with a flag: LTX's
timestep-conditioned blocks scale and shift the normed value per channel
(``* (1 + scale) + shift``), which is ``gamma`` / ``bias`` here.

The stock module computes this in several passes in ``x.dtype``; here it is one pass, fp32
throughout, rounded once to ``x.dtype``. Each program owns BLOCK_P whole pixels, all their
channels: one [BLOCK_P, BLOCK_C] tile, or for C = 3 * 2^k (every Wan channel count) three
unmasked [BLOCK_P, C/3] tiles (``rms_norm_silu_config``). C is the innermost, contiguous dimension (channels-last), so
the reduction stays inside the tile and loads are coalesced; many pixels per program keep the
launch small (one program per pixel costs far more than the arithmetic).

Folded input: ``x`` may come with up to two ``addends`` (same shape, dtype and strides) and an
``in_bias`` of C elements; the norm then takes ``s = x + addends... + in_bias``, summed in fp32 in
that order and never rounded. A conv computed as per-tap partial outputs, its bias not yet
added, is thus finished inside the norm's own memory pass rather than in passes of its own.
``out`` may be given (e.g. a time slice of a bigger cache buffer) to write the result in place.

Frame tail: ``tail`` may be a dense channels-last-3d (N, C, K, H, W) tensor that also receives
the last K frames of the result, stored from the same registers as the main output. A causal
video conv keeps its input's last frames for the next chunk (Wan's frame cache): written here
they need no copy pass of their own.

Padded output: ``out`` may also be a 5-D view whose pixels are not dense, e.g. the interior
``buf[:, :, t0:t1, 1:-1, 1:-1]`` of a conv input buffer with a one-pixel border. With
``out_border=1`` the kernel also writes that border as ``padding_mode="reflect"`` would (row -1
is row 1, row H is row H-2, the same for columns, corners from both), so a reflect-padded conv
input costs no pass of its own: the bytes the norm writes are the conv's input.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .accepts import (
    FLOAT_DTYPES,
    Accepts,
    autograd_reason,
    channel_stride_one,
    pixels_dense,
    same_layout,
)
from .backend import launch, on_device, tl, triton
from .silu import silu_f32, use_fast_silu
from .stacked_taps import TAPS, fill_stacked_

# One tile holds every channel of a pixel; beyond this a tile would need a loop over C.
MAX_CHANNELS = 8192
# CUDA limits grid dimension 1 (the batch axis here) to 65535.
MAX_BATCH = 65535
# The kernel has one pointer argument per addend; more would need a variadic kernel.
MAX_ADDENDS = 2

# What the kernel takes (``rms_norm_silu_unsupported`` and ``fastpath``'s checks ask this). An
# empty input is a no-op of the kernel's own.
RMS_NORM_SILU = Accepts(min_rank=4, max_rank=5, layout=pixels_dense,
                        layout_reason="input not channels-last (channels not the innermost contiguous dim)",
                        nonempty=False, max_channels=MAX_CHANNELS, max_batch=MAX_BATCH)


def reflect_border_(out: torch.Tensor, border: int) -> torch.Tensor:
    """Fill the ``border``-pixel frame around the 5-D view ``out`` (the interior of a bigger
    buffer) by reflection, rows first, then whole columns (so corners reflect in both)."""
    if border == 0:
        return out
    b, c, t, h, w = out.shape
    st = out.stride()
    base = out.as_strided((b, c, t, h + 2 * border, w + 2 * border), st,
                          out.storage_offset() - border * (st[3] + st[4]))
    p = border
    for i in range(1, p + 1):
        base[:, :, :, p - i, p:p + w].copy_(base[:, :, :, p + i, p:p + w])
        base[:, :, :, p + h - 1 + i, p:p + w].copy_(base[:, :, :, p + h - 1 - i, p:p + w])
    for j in range(1, p + 1):
        base[..., p - j].copy_(base[..., p + j])
        base[..., p + w - 1 + j].copy_(base[..., p + w - 1 - j])
    return out


def rms_norm_silu_reference(
    x, gamma, bias, eps=1e-12, silu=True, *, addends=(), in_bias=None, out=None, mean_eps=False,
    out_border=0, tail=None, stacked=None, stacked_first=0,
):
    """Stock math with fp32 accumulation; the test oracle (where the kernel declines, the caller
    runs the stock module).

    ``gamma``/``bias`` may be flat (C,) or the stock (C, 1, ...) parameters; ``gamma`` may be
    None (no scale), ``bias`` None or a python number; ``mean_eps`` selects the pixel norm.
    The norm's input is ``x + addends... + in_bias`` summed in fp32 in
    that order (the kernel's order). Returns
    ``x.dtype``: a new tensor, or ``out`` written in place when given; ``tail`` (5-D, K frames)
    gets the result's last K frames; ``stacked`` gets every frame in each slot it feeds
    (``stacked_taps.fill_stacked_``) and is returned.
    """
    channels = x.shape[1]
    shape = (channels,) + (1,) * (x.dim() - 2)
    xf = x.float()
    for a in addends:
        xf = xf + a.float()
    if in_bias is not None:
        xf = xf + in_bias.to(device=x.device, dtype=torch.float32).reshape(shape)
    if mean_eps:
        y = xf / torch.sqrt(xf.square().mean(dim=1, keepdim=True) + eps)
    else:
        y = xf / torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(eps) * (channels**0.5)
    if gamma is not None:
        y = y * gamma.to(device=x.device, dtype=torch.float32).reshape(shape)
    if isinstance(bias, torch.Tensor):
        b = bias.to(device=x.device, dtype=torch.float32)
        y = y + (b.reshape(shape) if b.numel() == channels else b)
    elif bias is not None and bias != 0:
        y = y + float(bias)
    if silu:
        y = F.silu(y)
    if tail is not None:
        tail.copy_(y[:, :, y.shape[2] - tail.shape[2]:])
    if stacked is not None:
        return fill_stacked_(stacked, y, stacked_first)
    if out is not None:
        return reflect_border_(out.copy_(y), out_border)
    return y.to(x.dtype)


def _param_reason(name: str, t, x: torch.Tensor, channels: int) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is {type(t).__name__}, not a tensor"
    if t.numel() != channels:
        return f"{name} has {t.numel()} elements for {channels} channels"
    if t.dtype not in FLOAT_DTYPES:
        return f"{name} dtype {t.dtype}"
    if t.device != x.device:  # e.g. ComfyUI low-VRAM offload: the stock path moves it per call
        return f"{name} on {t.device}, input on {x.device}"
    return None


def _addends_reason(addends, x: torch.Tensor) -> str | None:
    if not isinstance(addends, (tuple, list)):
        return f"addends is {type(addends).__name__}, not a tuple"
    if len(addends) > MAX_ADDENDS:
        return f"{len(addends)} addends (at most {MAX_ADDENDS})"
    for i, a in enumerate(addends):
        if not isinstance(a, torch.Tensor):
            return f"addend {i} is {type(a).__name__}, not a tensor"
        if a.dtype != x.dtype or a.device != x.device:
            return f"addend {i} is {a.dtype} on {a.device}, input {x.dtype} on {x.device}"
        if not same_layout(a, x):
            return f"addend {i} differs from the input in shape or strides"
    return None


def _out_reason(out, x: torch.Tensor, addends, out_border: int = 0) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"out is {type(out).__name__}, not a tensor"
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        return "out differs from the input in shape, dtype or device"
    if out_border not in (0, 1):
        return f"out_border {out_border} (0 or 1)"
    if not pixels_dense(out):
        if out.dim() != 5 or not channel_stride_one(out):
            return "out not channels-last (channels not the innermost contiguous dim)"
        if min(out.stride()[2:]) < 0:
            return "out with negative strides"
    if out_border:
        if out.dim() != 5:
            return "a reflected border needs a 5-D out"
        if out.shape[3] < 2 or out.shape[4] < 2:
            return "frame too small for a reflected border"
    if (out_border or not pixels_dense(out)) and math.prod(out.shape[2:]) >= 2**31:
        return "a strided out of 2**31 or more pixels per sample (int32 coordinates)"
    # Only exact aliasing is caught; a partial overlap is the caller's to avoid (see rms_norm_silu).
    if any(out.data_ptr() == t.data_ptr() for t in (x, *addends)):
        return "out aliases an input"
    return None


def _stacked_reason(stacked, first, x: torch.Tensor, out, out_border: int) -> str | None:
    if not isinstance(stacked, torch.Tensor):
        return f"stacked is {type(stacked).__name__}, not a tensor"
    if out is not None or out_border:
        return "stacked with out"
    if x.dim() != 5 or x.shape[0] != 1:
        return "stacked needs one 5-D video"
    c = x.shape[1]
    if (stacked.dim() != 4 or stacked.shape[1] != TAPS * c
            or tuple(stacked.shape[2:]) != tuple(x.shape[3:])):
        return f"stacked {tuple(stacked.shape)} does not hold frames of {tuple(x.shape)}"
    if stacked.dtype != x.dtype or stacked.device != x.device:
        return "stacked differs from the input in dtype or device"
    if not stacked.is_contiguous(memory_format=torch.channels_last):
        return "stacked not channels-last"
    if not isinstance(first, int) or first < 0:
        return f"stacked_first {first!r}"
    if math.prod(x.shape[2:]) >= 2**31:
        return "stacked frames of 2**31 or more pixels (int32 coordinates)"
    return None


def _tail_reason(tail, x: torch.Tensor, out, out_border: int) -> str | None:
    if not isinstance(tail, torch.Tensor):
        return f"tail is {type(tail).__name__}, not a tensor"
    if x.dim() != 5 or tail.dim() != 5:
        return "a frame tail needs 5-D tensors"
    if (tail.shape[:2] != x.shape[:2] or tail.shape[3:] != x.shape[3:]
            or not 0 < tail.shape[2] <= x.shape[2]):
        return f"tail {tuple(tail.shape)} is not the last frames of {tuple(x.shape)}"
    if tail.dtype != x.dtype or tail.device != x.device:
        return "tail differs from the input in dtype or device"
    if not pixels_dense(tail):
        return "tail not channels-last-3d"
    if out_border:
        return "a frame tail with a bordered out"
    return None


def rms_norm_silu_unsupported(
    x, gamma, bias, *, addends=(), in_bias=None, out=None, layout: bool = True, out_border: int = 0,
    tail=None, stacked=None, stacked_first: int = 0,
) -> str | None:
    """None when :func:`rms_norm_silu` takes these inputs; otherwise a short reason.

    ``layout=False`` leaves out the check of ``x``'s layout (for a caller that makes ``x``
    channels-last before the call).
    """
    reason = (RMS_NORM_SILU.tensor_reason(x, layout=layout)
              or RMS_NORM_SILU.channels_reason(x.shape[1]))
    if reason is not None:
        return reason
    channels = x.shape[1]
    reason = None if gamma is None else _param_reason("gamma", gamma, x, channels)
    if reason is not None:
        return reason
    if isinstance(bias, torch.Tensor):
        reason = _param_reason("bias", bias, x, channels)
        if reason is not None:
            return reason
    elif bias is not None and not isinstance(bias, (int, float)):
        return f"bias is {type(bias).__name__}"
    reason = _addends_reason(addends, x)
    if reason is not None:
        return reason
    if in_bias is not None:
        reason = _param_reason("in_bias", in_bias, x, channels)
        if reason is not None:
            return reason
    if out is not None:
        reason = _out_reason(out, x, addends, out_border)
        if reason is not None:
            return reason
    elif out_border:
        return "a reflected border needs out"
    if stacked is not None:
        reason = _stacked_reason(stacked, stacked_first, x, out, out_border)
        if reason is not None:
            return reason
        if any(stacked.data_ptr() == t.data_ptr() for t in (x, *addends)):
            return "stacked aliases an input"
    if tail is not None:
        reason = _tail_reason(tail, x, out, out_border)
        if reason is not None:
            return reason
        if any(tail.data_ptr() == t.data_ptr()
               for t in (x, *addends, *(t for t in (out, stacked) if t is not None))):
            return "tail aliases an input or out"
    return autograd_reason(x, gamma, bias, in_bias, out, tail, stacked, *addends)


@functools.lru_cache(maxsize=64)
def rms_norm_silu_config(channels: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps, SPLIT) for a launch; the one place to tune.

    A pixel's channels are SPLIT column tiles of BLOCK_C. Every Wan channel count is 3 * 2^k
    (96, 192, 384): one power-of-two tile would mask a quarter of its lanes (C=96 in 128), and
    it ran at about half of copy bandwidth whatever its tiling. Three unmasked tiles of C/3
    (H200, Wan 2.1 sizes, bf16, docs/benchmark/36af018, probe with a fast-division SiLU at 32
    pixels x 4 warps): 96 x 4 x 480 x 832 2.0 -> 3.6 TB/s (a clone: 3.6), 384 x 2 x 120 x 208
    0.57 -> 1.6 TB/s; with this kernel's exact SiLU, probed at 64 x 8 only: 3.1 and 1.2 TB/s.
    Other counts: one tile of about 8K elements, enough bytes in
    flight per program to hide memory latency, few enough fp32 registers per thread (8192 / 256
    threads = 32) not to spill.
    """
    del element_size  # the tile is sized in fp32 registers, whatever the storage dtype
    third = channels // 3
    if channels % 3 == 0 and third >= 16 and third & (third - 1) == 0:
        return 32, third, 4, 3
    block_c = triton.next_power_of_2(channels) if triton is not None else channels
    block_p = max(1, min(256, 8192 // block_c))
    num_warps = 8 if block_p * block_c >= 8192 else 4
    return block_p, block_c, num_warps, 1


if triton is not None:

    # ``pixels`` is a runtime int (one compilation for every frame size); ``channels`` stays
    # specialized: its divisibility by 16 is what lets the loads vectorize. The frame tail is a
    # runtime flag too: a decode's first call with one would otherwise compile a variant of
    # every norm inside the decode (the warm-up meets uncached calls). The operand flags stay
    # constexprs: as runtime flags the pass ran 7-8% slower plain and 15-32% slower with an
    # input bias and an addend (H200, Wan 2.1 sizes, 96-384 channels, interleaved), which
    # costs more than their variants' compile time in a warm-up that compiles in parallel.
    @triton.jit
    def _tile_input(x_ptr, a0_ptr, a1_ptr, in_bias_ptr, x_offs, mask, cols, col_mask,
                    N_ADDENDS: tl.constexpr, HAS_IN_BIAS: tl.constexpr):
        """One column tile of the norm's input, ``x + addends + in_bias`` in fp32."""
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        # The folded sum stays fp32 up to the norm, in the reference's order (x, addends,
        # in_bias): rounding it to x.dtype first would cost the precision the fusion keeps.
        if N_ADDENDS >= 1:
            x += tl.load(a0_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if N_ADDENDS >= 2:
            x += tl.load(a1_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_IN_BIAS:
            # Masked pixel rows pick up in_bias, but each row's norm is its own and they are
            # never stored.
            x += tl.load(in_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        return x

    @triton.jit
    def _tile_store(x, factor, gamma_ptr, bias_ptr, out_ptr, tail_ptr, rows, cols, col_mask,
                    mask, n, offs, out_stride_n, height, width, out_stride_t, out_stride_h,
                    out_stride_w, pixels, has_tail, tail_start, tail_stride_n, bias_scalar,
                    channels, stack_first, stack_frames, OUT_STRIDED: tl.constexpr,
                    REFLECT: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SILU: tl.constexpr, BLOCK_P: tl.constexpr, SLOTS: tl.constexpr):
        """The normed, scaled (and SiLU'd) column tile, stored to out (and the frame tail)."""
        y = x * factor[:, None]
        if HAS_GAMMA:
            y = y * tl.load(gamma_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y + b[None, :]
        else:
            y = y + bias_scalar
        if SILU != 0:
            y = silu_f32(y, SILU == 2)
        y = y.to(out_ptr.dtype.element_ty)
        if OUT_STRIDED:
            # int32 pixel coordinates (the host keeps pixels per sample under 2**31): int64
            # division costs several times as many instructions, in a memory-bound pass.
            r32 = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
            frame = height * width
            t = r32 // frame
            h = (r32 - t * frame) // width
            w = r32 - t * frame - h * width
            hw_at = h.to(tl.int64) * out_stride_h + w.to(tl.int64) * out_stride_w
            at = n * out_stride_n + t.to(tl.int64) * out_stride_t + hw_at
            if SLOTS > 1:
                # The stacked layout (``stacked_taps``): frame t also feeds slot k of output
                # frame t + stack_first - k, k channel-widths further along the pixel.
                for k in tl.static_range(SLOTS):
                    tk = t + stack_first - k
                    ok = (tk >= 0) & (tk < stack_frames)
                    at_k = tk.to(tl.int64) * out_stride_t + hw_at + k * channels
                    tl.store(out_ptr + at_k[:, None] + cols[None, :], y, mask=mask & ok[:, None])
            else:
                dst = out_ptr + at[:, None] + cols[None, :]
                tl.store(dst, y, mask=mask)
            if REFLECT:
                # The one-pixel border by reflection: row -1 <- row 1, row H <- row H-2 (the same
                # for columns); a pixel may feed two rows, two columns and four corners. Each
                # group is stored only by tiles that hold such a pixel (a predicated-off store
                # still costs its address arithmetic on every element).
                valid = rows < pixels
                up = (h == 1) & valid
                down = (h == height - 2) & valid
                left = (w == 1) & valid
                right = (w == width - 2) & valid
                dh = 2 * out_stride_h
                dw = 2 * out_stride_w
                if tl.max((up | down).to(tl.int32), axis=0) > 0:
                    tl.store(dst - dh, y, mask=up[:, None] & col_mask[None, :])
                    tl.store(dst + dh, y, mask=down[:, None] & col_mask[None, :])
                    if tl.max(((up | down) & (left | right)).to(tl.int32), axis=0) > 0:
                        tl.store(dst - dh - dw, y, mask=(up & left)[:, None] & col_mask[None, :])
                        tl.store(dst - dh + dw, y, mask=(up & right)[:, None] & col_mask[None, :])
                        tl.store(dst + dh - dw, y, mask=(down & left)[:, None] & col_mask[None, :])
                        tl.store(dst + dh + dw, y, mask=(down & right)[:, None] & col_mask[None, :])
                if tl.max((left | right).to(tl.int32), axis=0) > 0:
                    tl.store(dst - dw, y, mask=left[:, None] & col_mask[None, :])
                    tl.store(dst + dw, y, mask=right[:, None] & col_mask[None, :])
        else:
            tl.store(out_ptr + n * out_stride_n + offs, y, mask=mask)
        # Only the programs whose pixels reach the tail store there (a predicated-off store
        # would still cost its address arithmetic on every element).
        if has_tail != 0:
            if tl.program_id(0).to(tl.int64) * BLOCK_P + BLOCK_P > tail_start:
                t_rows = rows - tail_start
                t_offs = n * tail_stride_n + t_rows[:, None] * channels + cols[None, :]
                tl.store(tail_ptr + t_offs, y, mask=mask & (t_rows >= 0)[:, None])

    # ``pixels`` is a runtime int (one compilation for every frame size); ``channels`` stays
    # specialized: its divisibility by 16 is what lets the loads vectorize. The frame tail is a
    # runtime flag too: a decode's first call with one would otherwise compile a variant of
    # every norm inside the decode (the warm-up meets uncached calls). The operand flags stay
    # constexprs: as runtime flags the pass ran 7-8% slower plain and 15-32% slower with an
    # input bias and an addend (H200, Wan 2.1 sizes, 96-384 channels, interleaved), which
    # costs more than their variants' compile time in a warm-up that compiles in parallel.
    # ``tail_stride_n`` keeps its multiple-of-16 class (0 for batch 1, a dense stride of
    # 16k-channel frames otherwise: the same class, no new variant): runtime, the tail frames
    # were stored two bytes at a time and the kernel took 184 registers instead of 128 (sm90
    # PTX of the Wan 2.1 widths, docs/benchmark/s31/compile-sm90-kernels.log; not yet timed).
    @triton.jit(do_not_specialize=["pixels", "height", "width", "has_tail", "tail_start",
                                   "stack_first", "stack_frames"])
    def _rms_norm_silu_kernel(
        x_ptr,
        a0_ptr,  # addends: x's strides, read only when N_ADDENDS says so
        a1_ptr,
        in_bias_ptr,
        gamma_ptr,
        bias_ptr,
        out_ptr,
        tail_ptr,  # read only when has_tail: the last frames of out, again
        pixels,  # per sample
        channels,
        x_stride_n,
        out_stride_n,
        height,  # frame size and out's strides: read only when OUT_STRIDED
        width,
        out_stride_t,
        out_stride_h,
        out_stride_w,
        has_tail,  # 0 / 1
        tail_start,  # first pixel (per sample) that tail holds
        tail_stride_n,
        scale,
        eps,
        bias_scalar,
        stack_first,  # read only when SLOTS > 1: the stacked layout (``stacked_taps``)
        stack_frames,
        OUT_STRIDED: tl.constexpr,
        REFLECT: tl.constexpr,
        N_ADDENDS: tl.constexpr,
        HAS_IN_BIAS: tl.constexpr,
        HAS_GAMMA: tl.constexpr,
        MEAN_EPS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,  # 0 none, 1 the library's form, 2 the MUFU form (``kernels.silu``)
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
        SPLIT: tl.constexpr,  # 1, or 3: channels = 3 * BLOCK_C, three unmasked column tiles
        SLOTS: tl.constexpr,  # 1, or the stacked layout's slots per output frame
    ):
        # int64 throughout: a Wan decode tensor has >2**31 elements at larger sizes.
        n = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        row_mask = (rows < pixels)[:, None]
        cols_a = tl.arange(0, BLOCK_C)
        col_mask_a = cols_a < channels
        mask_a = row_mask & col_mask_a[None, :]
        offs_a = rows[:, None] * channels + cols_a[None, :]
        xa = _tile_input(x_ptr, a0_ptr, a1_ptr, in_bias_ptr, n * x_stride_n + offs_a, mask_a,
                         cols_a, col_mask_a, N_ADDENDS, HAS_IN_BIAS)
        # Masked lanes load 0, so they do not change the sum of squares.
        sum_sq = tl.sum(xa * xa, axis=1)
        if SPLIT == 3:
            # The second and third thirds of each pixel's channels: every lane is a channel.
            xb = _tile_input(x_ptr, a0_ptr, a1_ptr, in_bias_ptr,
                             n * x_stride_n + offs_a + BLOCK_C, mask_a, cols_a + BLOCK_C,
                             col_mask_a, N_ADDENDS, HAS_IN_BIAS)
            xc = _tile_input(x_ptr, a0_ptr, a1_ptr, in_bias_ptr,
                             n * x_stride_n + offs_a + 2 * BLOCK_C, mask_a, cols_a + 2 * BLOCK_C,
                             col_mask_a, N_ADDENDS, HAS_IN_BIAS)
            sum_sq += tl.sum(xb * xb, axis=1) + tl.sum(xc * xc, axis=1)
        if MEAN_EPS:
            factor = 1.0 / tl.sqrt(sum_sq / channels + eps)
        else:
            factor = scale / tl.maximum(tl.sqrt(sum_sq), eps)
        _tile_store(xa, factor, gamma_ptr, bias_ptr, out_ptr, tail_ptr, rows, cols_a, col_mask_a,
                    mask_a, n, offs_a, out_stride_n, height, width, out_stride_t, out_stride_h,
                    out_stride_w, pixels, has_tail, tail_start, tail_stride_n, bias_scalar,
                    channels, stack_first, stack_frames, OUT_STRIDED, REFLECT, HAS_GAMMA, HAS_BIAS,
                    SILU, BLOCK_P, SLOTS)
        if SPLIT == 3:
            _tile_store(xb, factor, gamma_ptr, bias_ptr, out_ptr, tail_ptr, rows, cols_a + BLOCK_C,
                        col_mask_a, mask_a, n, offs_a + BLOCK_C, out_stride_n, height, width,
                        out_stride_t, out_stride_h, out_stride_w, pixels, has_tail, tail_start,
                        tail_stride_n, bias_scalar, channels, stack_first, stack_frames, OUT_STRIDED,
                        REFLECT, HAS_GAMMA, HAS_BIAS, SILU, BLOCK_P, SLOTS)
            _tile_store(xc, factor, gamma_ptr, bias_ptr, out_ptr, tail_ptr, rows,
                        cols_a + 2 * BLOCK_C, col_mask_a, mask_a, n, offs_a + 2 * BLOCK_C,
                        out_stride_n, height, width, out_stride_t, out_stride_h, out_stride_w,
                        pixels, has_tail, tail_start, tail_stride_n, bias_scalar, channels,
                        stack_first, stack_frames, OUT_STRIDED, REFLECT, HAS_GAMMA, HAS_BIAS, SILU,
                        BLOCK_P, SLOTS)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def rms_norm_silu(
    x, gamma, bias, eps=1e-12, silu=True, *, addends=(), in_bias=None, out=None, mean_eps=False,
    out_border=0, tail=None, stacked=None, stacked_first=0, fast_silu=False,
) -> torch.Tensor | None:
    """Fused RMS norm (+ SiLU) of a channels-last 4-D / channels-last-3d 5-D tensor
    (``mean_eps``: the pixel norm; ``gamma`` None: no scale).

    The norm's input is ``x + addends... + in_bias`` (fp32, see the module docstring). Returns
    None when :func:`rms_norm_silu_unsupported` gives a reason (the caller then takes the stock
    path); otherwise ``out`` written in place, or when ``out`` is None a new tensor of
    ``x.dtype`` in ``x``'s channels-last memory format. ``out`` must not overlap ``x`` or an
    addend: tiles are read and written by different programs in no set order. ``out`` may be
    a strided 5-D view with contiguous channels; with ``out_border=1`` it is the interior of a
    buffer one pixel wider on each side of H and W, whose border is written by reflection (the
    caller owns that memory; see the module docstring). ``tail``: a dense channels-last-3d
    tensor of the last K frames' shape, written with them. ``stacked``: instead of ``out``, a
    (T, 3C, H, W) channels-last conv input of ``stacked_taps``, which gets frame i of a 5-D
    batch-1 result (sequence frame ``stacked_first + i``) in every slot it feeds; returned.
    ``fast_silu``: SiLU's MUFU form where the device takes it (``kernels.silu``).
    """
    reason = rms_norm_silu_unsupported(x, gamma, bias, addends=addends, in_bias=in_bias, out=out,
                                       out_border=out_border, tail=tail, stacked=stacked,
                                       stacked_first=stacked_first)
    if reason is not None:
        return None
    slots = 1
    if stacked is not None:
        # The kernel's strided store, with the buffer's frame / row / pixel strides.
        out, slots = stacked, TAPS
    elif out is None:
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    if x.numel() == 0:
        return out
    strided = slots > 1 or not pixels_dense(out) or out_border > 0
    batch, channels = x.shape[0], x.shape[1]
    pixels = x.numel() // (batch * channels)
    # Absent tensors get x as a placeholder pointer; the constexprs keep it unread.
    gamma_flat = x if gamma is None else _flat(gamma)
    has_bias = isinstance(bias, torch.Tensor)
    bias_flat = _flat(bias) if has_bias else x
    bias_scalar = 0.0 if has_bias or bias is None else float(bias)
    a0, a1 = (tuple(addends) + (x, x))[:2]
    in_bias_flat = x if in_bias is None else _flat(in_bias)
    block_p, block_c, num_warps, split = rms_norm_silu_config(channels, x.element_size())
    grid = (-(-pixels // block_p), batch)  # host arithmetic (triton.cdiv is slow from Python)
    args = (
        x,
        a0,
        a1,
        in_bias_flat,
        gamma_flat,
        bias_flat,
        out,
        x if tail is None else tail,
        pixels,
        channels,
        x.stride(0) if batch > 1 else 0,
        out.stride(0) if batch > 1 else 0,
        *((x.shape[3], x.shape[4], out.stride(0), *out.stride()[2:]) if slots > 1 else
          (out.shape[3], out.shape[4], *out.stride()[2:]) if strided else (1, 1, 0, 0, 0)),
        int(tail is not None),
        pixels - (0 if tail is None else math.prod(tail.shape[2:])),
        tail.stride(0) if tail is not None and batch > 1 else 0,
        float(channels) ** 0.5,
        float(eps),
        bias_scalar,
        stacked_first,
        out.shape[0] if slots > 1 else 0,
    )
    meta = {
        "OUT_STRIDED": strided,
        "REFLECT": out_border > 0,
        "N_ADDENDS": len(addends),
        "HAS_IN_BIAS": in_bias is not None,
        "HAS_GAMMA": gamma is not None,
        "MEAN_EPS": bool(mean_eps),
        "HAS_BIAS": has_bias,
        "SILU": (2 if use_fast_silu(fast_silu, x.device) else 1) if silu else 0,
        "BLOCK_P": block_p,
        "BLOCK_C": block_c,
        "SPLIT": split,
        "SLOTS": slots,
    }
    with on_device(x.device):
        launch(_rms_norm_silu_kernel, grid, *args, **meta, num_warps=num_warps)
    return out
