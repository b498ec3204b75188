"""Attention scores turned into unnormalised probabilities inside the score GEMM.

``exp_scores(q, k, ref)`` writes ``E = exp(q k^T - ref)`` (``ref`` one value per query row) in
the inputs' dtype, and the sum of each row of the written ``E``. The softmax of a row is
``E / sum``, so an attention ``softmax(q k^T) v`` is ``(E v) / sum``: the GEMM against ``v`` and
one division of its small output. No score tensor is written and then read back by a softmax
pass (at 2048² the KL mid-block's scores are 65536 x 65536: torch's softmax moved them three
times, 8 of an 86 ms SDXL decode on the H200).

The reference ``ref`` replaces the row maximum a softmax subtracts. Any value works in exact
arithmetic; in floating point it must keep the row's ``E`` inside bf16's range (fp32's:
2^-126 .. 2^127) where it matters. The caller picks it and checks it with the row sums it gets
back (``vae_attention.attention_exp_scores``).

Math: fp32 accumulation of ``q k^T`` (bf16 tensor-core products), ``exp2`` of the scaled
score, one rounding to the output dtype; the row sums add the rounded values in fp32, tile by
tile, then the tiles in a fixed order (deterministic). Each tile's base offset is int64 (a
chunk of rows times 65536 keys passes 2^31 elements); offsets inside a tile are int32
(``MAX_KEYS``). Under ``TRITON_INTERPRET=1`` the tiles are widened to fp32 before ``tl.dot``
(the interpreter's bf16 product is wrong; bf16 values are exact in fp32).

Two kernels compute this. ``_exp_scores_tma_kernel`` (sm90 and later, where Triton has tensor
descriptors; ``TMA_CONFIG``, the default) is persistent: one program per SM walks the tiles, q
and k arrive by TMA, E leaves by TMA, and the tile loop is flattened into the K loop so the next
tile's loads are issued during this tile's exp-and-store epilogue. ``_exp_scores_kernel`` (one
program per tile, pointer loads; ``POINTER_CONFIG``) takes every tensor the first cannot. At
SDXL 2048²'s chunk (8192 x 65536 x 512, bf16, one H200, s41's ``attn_tma.py.txt``) the first
takes 1.084-1.098 ms and the second 1.283-1.337; cuBLAS's plain ``q k^T`` with no exp takes
0.84-0.90. Tiles tried for the first: 128x256x64 at 8 warps and 3 stages is the fastest of
nine (128x128: 1.55 ms; 256x128: 1.27; not flattened 1.27-1.77; 4 stages do not fit in shared
memory).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .accepts import autograd_reason
from .backend import interpreting, launch, on_device, tl, triton, triton_unavailable_reason

try:  # Triton 3.4+: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # no Triton, or an older one: the pointer kernel only
    TensorDescriptor = None

# bf16 only: it has fp32's exponent range, which ``ref``'s headroom is sized for (fp16's
# largest value, 65504, would overflow at e^11.1).
EXP_SCORES_DTYPES = (torch.bfloat16,)


class ExpScoresConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # The persistent TMA kernel where the tensors allow it (``tma_unavailable_reason``).
    tma: bool = False


# The one place to tune; the interpreter tests pass small blocks of their own. In sm90
# compiles (Triton 3.8, ptxas -v) 128x128x64 at 8 warps uses 109 registers and 96 KiB of shared
# memory, so two programs fit an SM and one's exp-and-store epilogue overlaps the other's MMAs;
# 128x256 needs 203 registers (one program per SM). Neither spills; both pipeline their loads
# (cp.async, 3 stages) and store 16 bytes at a time. Timed on an H100, the whole SDXL 2048²
# attention: 16.47 against 16.89 ms (docs/benchmark/s31/h100).
POINTER_CONFIG = ExpScoresConfig(block_m=128, block_n=128, block_k=64, num_warps=8,
                                 num_stages=3)
# The TMA kernel's tiles (see the module's note); it falls back to POINTER_CONFIG where it
# cannot run (``tma_unavailable_reason``). The default since s44, whose GPU run (H100) passed
# the exp_scores, CUDA-graph, prewarm and KL-family GPU tests with it inside decodes.
TMA_CONFIG = ExpScoresConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                             tma=True)
EXP_SCORES_CONFIG = TMA_CONFIG
# Offsets inside a tile are int32 (fewer registers than an int64 per element): a tile's rows
# span BLOCK_M * keys elements, under 2^31 for up to 256-row tiles.
MAX_KEYS = (2 ** 31 - 1) // 256


def exp_scores_reference(q: torch.Tensor, k: torch.Tensor,
                         ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``E``, row sums) in plain torch, fp32 math: the test oracle."""
    e = torch.exp(q.float() @ k.float().transpose(-1, -2) - ref.float()[..., None]).to(q.dtype)
    return e, e.float().sum(-1)


def exp_scores_unsupported(q: torch.Tensor, k: torch.Tensor,
                           ref: torch.Tensor | None = None) -> str | None:
    """Why ``exp_scores`` cannot take these tensors (short, for the log); None if it can.
    Without ``ref`` only ``q`` and ``k`` are asked about."""
    reason = triton_unavailable_reason(q)
    if reason is not None:
        return reason
    if q.dim() != 3 or k.dim() != 3:
        return "q and k must be (batch, tokens, channels)"
    if q.dtype not in EXP_SCORES_DTYPES or k.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} (bf16 for both)"
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or channels"
    if q.numel() == 0 or k.numel() == 0:
        return "empty"
    if q.stride(2) != 1 or k.stride(2) != 1:
        return "channels not contiguous"
    if k.shape[1] > MAX_KEYS:
        return f"{k.shape[1]} keys (at most {MAX_KEYS})"
    if k.device != q.device:
        return "q and k on different devices"
    if ref is not None and (ref.shape != q.shape[:2] or ref.dtype != torch.float32
                            or not ref.is_contiguous() or ref.device != q.device):
        return "ref must be contiguous fp32 of shape (batch, query tokens) on q's device"
    return autograd_reason(q, k)


def exp_scores(q: torch.Tensor, k: torch.Tensor, ref: torch.Tensor,
               config: ExpScoresConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(E, sums)``: ``E = exp(q k^T - ref[..., None])`` (batch, Lq, Lk) contiguous in q's
    dtype and ``sums`` (batch, Lq) fp32, the row sums of ``E`` as written. ``ref`` is in the
    scores' units (natural log). None, nothing written, when ``exp_scores_unsupported`` gives a
    reason."""
    if exp_scores_unsupported(q, k, ref) is not None:
        return None
    cfg = config or EXP_SCORES_CONFIG
    if cfg.tma and tma_unavailable_reason(q, k) is not None:
        cfg = POINTER_CONFIG
    batch, lq, d = q.shape
    lk = k.shape[1]
    tiles_n = -(-lk // cfg.block_n)
    e = torch.empty(batch, lq, lk, dtype=q.dtype, device=q.device)
    partial = torch.empty(batch, lq, tiles_n, dtype=torch.float32, device=q.device)
    if cfg.tma:
        _launch_tma(q, k, ref, e, partial, cfg)
        return e, partial.sum(-1)
    # Query tiles vary fastest, so the programs running together share one key tile (read
    # from memory once) and the chunk's queries stay in L2.
    grid = (-(-lq // cfg.block_m), tiles_n, batch)
    with on_device(q.device):
        launch(_exp_scores_kernel, grid, q, k, ref, e, partial, lq, lk, d,
               q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
               DOT_FP32=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return e, partial.sum(-1)


def tma_unavailable_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the persistent TMA kernel cannot take ``q`` and ``k`` (``exp_scores`` then runs the
    pointer kernel); None if it can. TMA wants 16-byte aligned bases and row strides."""
    if TensorDescriptor is None:
        return "this Triton has no tensor descriptors"
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (9, 0):
        return "TMA needs sm90 or later"
    item = q.element_size()
    for name, t in (("q", q), ("k", k)):
        if t.data_ptr() % 16 or (t.stride(1) * item) % 16 or (t.stride(0) * item) % 16:
            return f"{name} is not 16-byte aligned row by row"
    if (k.shape[1] * item) % 16:
        return f"{k.shape[1]} keys: E's rows would not be 16-byte aligned"
    return None


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each walking several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tma(q, k, ref, e, partial, cfg: ExpScoresConfig) -> None:
    batch, lq, _ = q.shape
    lk = k.shape[1]
    tiles_m, tiles_n = -(-lq // cfg.block_m), partial.shape[-1]
    # One program per SM whatever the size (those past the last tile exit at once): the count
    # is a constexpr, so the warm-up's tiny call compiles the variant a 2048² decode runs.
    programs = _programs(q.device)
    with on_device(q.device):
        for b in range(batch):  # a batch is a few images at most: one launch each
            # Descriptors per sample: TMA clips E's ragged tiles and zero-fills q's and k's,
            # and its coordinates are per dimension, so E past 2^31 elements needs no int64.
            launch(_exp_scores_tma_kernel, (programs,),
                   TensorDescriptor.from_tensor(q[b], [cfg.block_m, cfg.block_k]),
                   TensorDescriptor.from_tensor(k[b], [cfg.block_n, cfg.block_k]),
                   TensorDescriptor.from_tensor(e[b], [cfg.block_m, cfg.block_n]),
                   ref[b], partial[b], lq, lk, tiles_m, tiles_n, D=q.shape[2],
                   BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                   PROGRAMS=programs, DOT_FP32=interpreting(), num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages)


if triton is not None:

    # Sizes unspecialised (E is addressed through its descriptor): the warm-up's tiny call
    # compiles the variant every size runs.
    @triton.jit(do_not_specialize=["lq", "lk", "tiles_m", "tiles_n"])
    def _exp_scores_tma_kernel(q_desc, k_desc, e_desc, ref_ptr, part_ptr, lq, lk, tiles_m,
                               tiles_n, D: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr):
        # Query tiles vary fastest, so the programs running together share one key tile.
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            pid_m = tile % tiles_m
            pid_n = tile // tiles_m
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # A constant trip count (D is the model's width: one variant per VAE) lets the
            # flattened loop pipeline across tiles, as in the timed lab kernel.
            for start in range(0, D, BLOCK_K):
                a = q_desc.load([pid_m * BLOCK_M, start])
                bt = k_desc.load([pid_n * BLOCK_N, start])
                if DOT_FP32:  # see the module's note
                    a = a.to(tl.float32)
                    bt = bt.to(tl.float32)
                acc = tl.dot(a, bt.T, acc)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < lq
            ref = tl.load(ref_ptr + rows, mask=row_ok, other=0.0)
            e = tl.exp2(acc * 1.4426950408889634 - (ref * 1.4426950408889634)[:, None])
            e = e.to(tl.bfloat16)  # EXP_SCORES_DTYPES
            e_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], e)
            # Keys past lk were zero-filled (their E is exp(-ref), not 0): out of the sums.
            part = tl.sum(tl.where((cols < lk)[None, :], e.to(tl.float32), 0.0), axis=1)
            tl.store(part_ptr + rows.to(tl.int64) * tiles_n + pid_n, part, mask=row_ok)

    # Strides, channels and keys keep Triton's multiple-of-16 specialisation (their class is
    # the same at every real size): without it the loads did not pipeline and E was stored two
    # bytes at a time (sm90 PTX). The query count varies by chunk and is not specialised.
    @triton.jit(do_not_specialize=["lq"])
    def _exp_scores_kernel(q_ptr, k_ptr, ref_ptr, e_ptr, part_ptr, lq, lk, d,
                           sqb, sqm, skb, skn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < lq
        col_ok = cols < lk
        q_rows = q_ptr + b * sqb + rows.to(tl.int64)[:, None] * sqm
        k_rows = k_ptr + b * skb + cols.to(tl.int64)[:, None] * skn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, d, BLOCK_K):
            kk = start + ks
            a = tl.load(q_rows + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < d), other=0.0)
            bt = tl.load(k_rows + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < d), other=0.0)
            if DOT_FP32:  # see the module's note
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            acc = tl.dot(a, tl.trans(bt), acc)
        ref = tl.load(ref_ptr + b * lq + rows, mask=row_ok, other=0.0)
        # exp(x) = exp2(x * log2(e)): exp2 is the hardware's instruction.
        e = tl.exp2(acc * 1.4426950408889634 - (ref * 1.4426950408889634)[:, None])
        e = e.to(e_ptr.dtype.element_ty)
        # int64 tile base, int32 offsets inside the tile (``MAX_KEYS``).
        tile = e_ptr + (b * lq + pid_m * BLOCK_M) * lk + pid_n * BLOCK_N
        inner = tl.arange(0, BLOCK_M)[:, None] * lk + tl.arange(0, BLOCK_N)[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(tile + inner, e, mask=ok)
        part = tl.sum(tl.where(ok, e.to(tl.float32), 0.0), axis=1)
        tiles = tl.num_programs(1)
        tl.store(part_ptr + (b * lq + rows.to(tl.int64)) * tiles + pid_n, part, mask=row_ok)


__all__ = ["EXP_SCORES_CONFIG", "POINTER_CONFIG", "TMA_CONFIG", "ExpScoresConfig", "exp_scores",
           "exp_scores_reference", "exp_scores_unsupported", "tma_unavailable_reason"]
