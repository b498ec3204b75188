"""Single-head attention of the KL VAE mid-block ``AttnBlock``, with its projections folded.

The stock block (ComfyUI ``AttnBlock``, diffusers ``Attention`` with one head) computes, per
image, with ``h`` the GroupNorm'ed input as L = H*W tokens of C channels (column vectors):

    q_i = Wq h_i + bq,  k_j = Wk h_j + bk,  v_j = Wv h_j + bv
    P   = softmax_j(q_i . k_j / sqrt(C))
    out = x + Wo (sum_j P_ij v_j) + bo

Two facts remove three of the four projections:

- Scores. ``q_i . k_j = h_i^T Wq^T Wk h_j + bq^T Wk h_j + (terms that depend on i only)``.
  Softmax over j is invariant to adding a constant per query row, so the i-only terms
  (``h_i^T Wq^T bk + bq^T bk``) drop, and ``P = softmax_j(q'_i . h_j)`` with
  ``q'_i = s * (Wk^T Wq h_i + Wk^T bq)``, ``s = 1/sqrt(C)``. In the brief's notation,
  ``A = Wq^T Wk`` and ``q'_i = s * (A^T h_i + c)``, ``c = Wk^T bq``. Keys are ``h`` itself.
- Values/output. Rows of P sum to 1, so ``Wo (sum_j P_ij (Wv h_j + bv)) + bo
  = sum_j P_ij (Wo Wv h_j) + (Wo bv + bo)``: one projection ``v'_j = (Wo Wv) h_j`` and one
  bias added after the attention.

So the fast block runs two C x C GEMMs over the tokens (``q'`` and ``v'``) instead of four.
The folded weights are caches built once per model (``fold_attention_weights``).

Layout. The fast block should work on tokens in channels-last order: for ``x`` of shape
(N, C, H, W) stored channels-last, ``x.permute(0, 2, 3, 1).reshape(N, H*W, C)`` is a free view
(``to_tokens``), and ``from_tokens`` is the free inverse, giving a channels-last (N, C, H, W)
view. Row-major (N, L, C) tokens are what GEMMs and attention kernels want, so no transpose is
ever materialised. Stock ComfyUI, on NCHW tensors, copies q, k and v to that layout and back.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .exp_scores import exp_scores, exp_scores_unsupported
from .softmax_rows import softmax_rows


class FoldedAttention(NamedTuple):
    """Folded ``AttnBlock`` weights, in ``F.linear`` layout ([out, in]) over row tokens.

    ``q' = F.linear(h, query_weight, query_bias)`` (softmax scale included), keys are ``h``,
    ``v' = F.linear(h, value_weight)``, and ``out = x + attention(q', h, v') + out_bias``.
    """

    query_weight: torch.Tensor  # [C, C] = s * Wk^T Wq   (= s * A^T)
    query_bias: torch.Tensor  # [C]    = s * Wk^T bq   (= s * c)
    value_weight: torch.Tensor  # [C, C] = Wo Wv
    out_bias: torch.Tensor  # [C]    = Wo bv + bo


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    """A 1x1 conv weight [out, in, 1, 1] (or a linear weight [out, in]) as [out, in]."""
    if weight.dim() == 4:
        if tuple(weight.shape[2:]) != (1, 1):
            raise ValueError(f"expected a 1x1 conv weight, got {tuple(weight.shape)}")
        return weight.reshape(weight.shape[0], weight.shape[1])
    if weight.dim() != 2:
        raise ValueError(
            f"expected a [out, in] or [out, in, 1, 1] weight, got {tuple(weight.shape)}"
        )
    return weight


def fold_attention_weights(
    wq: torch.Tensor,
    bq: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    *,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> FoldedAttention:
    """Fold the four projections of a single-head ``AttnBlock`` (see the module docstring).

    Weights are 1x1 conv ([C, C, 1, 1]) or linear ([C, C]) weights; biases may be None.
    ``scale`` defaults to ``1/sqrt(d)`` with d the query/key width (stock SDPA's default).
    ``bk`` is accepted for a uniform signature and unused: it only adds per-query constants.
    The result is cast to ``dtype`` (default: ``wq``'s dtype).
    """
    del bk  # its terms are constant per query row; softmax ignores them
    out_dtype = wq.dtype if dtype is None else dtype
    # The products sum C = 512 terms each. Doing them in fp64 makes the fold's own error
    # negligible, so the single cast to ``out_dtype`` is the only rounding of the folded
    # weights (costs nothing: four 512^3 products, once per model). fp64 is missing on MPS.
    work = torch.float32 if wq.device.type == "mps" else torch.float64
    wq_, wk_, wv_, wo_ = (_matrix(w).to(work) for w in (wq, wk, wv, wo))
    d = wq_.shape[0]
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    def bias(b: torch.Tensor | None, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=work, device=wq.device) if b is None else b.to(work)

    query_weight = scale * (wk_.T @ wq_)
    query_bias = scale * (wk_.T @ bias(bq, d))
    value_weight = wo_ @ wv_
    out_bias = wo_ @ bias(bv, wv_.shape[0]) + bias(bo, wo_.shape[0])
    return FoldedAttention(
        *(t.to(out_dtype).contiguous() for t in (query_weight, query_bias, value_weight, out_bias))
    )


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H*W, C). A free view when ``x`` is channels-last, a copy otherwise."""
    n, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(n, h * w, c)


def from_tokens(t: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(N, H*W, C) -> (N, C, H, W); a channels-last view of contiguous ``t`` (no copy)."""
    n, _, c = t.shape
    return t.reshape(n, height, width, c).permute(0, 3, 1, 2)


_HALF = (torch.float16, torch.bfloat16)


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` with an fp32 result: for half inputs on CUDA straight from the GEMM's
    fp32 accumulator (newer torch), else in fp32 from widened inputs (exact widening)."""
    if a.is_cuda and a.dtype in _HALF:
        # Only "overload missing" errors fall through: an out-of-memory error must propagate.
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (TypeError, NotImplementedError):
            pass
    return torch.matmul(a.float(), b.float())


def _scores(qc: torch.Tensor, kt: torch.Tensor, fp32: bool) -> torch.Tensor:
    if not fp32 or qc.dtype == torch.float32:
        return torch.matmul(qc, kt)
    return _matmul_fp32(qc, kt)


def attention_chunk_size(
    batch: int,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
    budget_bytes: int = 1 << 30,
    fp32_scores: bool = False,
) -> int:
    """Query rows per chunk so the live score-sized tensors of one chunk fit ``budget_bytes``.

    Per score element: the scores and the softmax output (both in the input dtype), or with
    ``fp32_scores`` fp32 scores, fp32 probabilities and their cast to the input dtype.
    """
    item = torch.empty((), dtype=dtype).element_size()
    per_element = (8 + item) if (fp32_scores and dtype != torch.float32) else 2 * item
    rows = budget_bytes // max(1, batch * k_len * per_element)
    return int(min(q_len, max(1, rows)))


def attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: int | None = None,
    *,
    budget_bytes: int = 1 << 30,
    fp32_scores: bool = False,
    row_softmax: bool = True,
    scale: float = 1.0,
) -> torch.Tensor:
    """``softmax(q k^T) v`` over tokens (N, L, d), by chunks of query rows.

    The softmax scale is ``scale`` (default 1: folded into ``q`` already, as
    ``fold_attention_weights`` does), applied to the scores in the softmax's fp32 math.
    ``chunk`` query rows are processed at a time, so the score matrix held at once is ``N * chunk * Lk`` elements; by default ``chunk`` is the largest that
    keeps it within ``budget_bytes`` (``attention_chunk_size``). At 2048^2 output the mid-block
    has 65 536 tokens: a full bf16 score matrix would be 8 GiB.

    Precision for fp16/bf16 inputs: the GEMMs accumulate in fp32 and torch's softmax kernels
    compute in fp32 internally (CUDA and CPU), but by default the scores are rounded to the
    input dtype before the softmax (bf16: ~2^-9 relative, i.e. an absolute logit error that
    grows with the logit size). ``fp32_scores=True`` keeps scores and softmax in fp32 and
    rounds only the probabilities, at 2.5x the score memory (``attention_chunk_size``).

    ``row_softmax``: the softmax is ``softmax_rows`` (Triton; in place on half scores, so one
    score-sized tensor per chunk less than the budget allows for) where it takes the scores,
    torch's otherwise; the same fp32 math up to rounding.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("attention_chunked takes (N, L, d) tokens")
    n, lq, _ = q.shape
    fp32 = fp32_scores and q.dtype in _HALF
    if chunk is None:
        chunk = attention_chunk_size(n, lq, k.shape[1], q.dtype, budget_bytes, fp32)
    chunk = max(1, min(int(chunk), lq))
    kt = k.transpose(1, 2)
    out = torch.empty(n, lq, v.shape[2], dtype=v.dtype, device=v.device)
    for start in range(0, lq, chunk):
        stop = min(start + chunk, lq)
        scores = _scores(q[:, start:stop], kt, fp32)
        probs = None
        if row_softmax:
            target = scores if scores.dtype == v.dtype else torch.empty(
                scores.shape, dtype=v.dtype, device=scores.device)
            probs = softmax_rows(scores, out=target, scale=scale)
        if probs is None:
            probs = torch.softmax(scores if scale == 1.0 else scores.float() * scale, dim=-1)
        out[:, start:stop] = torch.matmul(probs.to(v.dtype), v)
    return out


# ``attention_exp_scores``: each query row's reference is its best score among about
# EXP_SCORES_SAMPLED_KEYS evenly strided keys, a score the row really has, so its largest E is
# at least ~1 and no E of the row leaves bf16's range at the small end. A row whose sum exceeds
# 2^EXP_SCORES_TRIP_LOG2 has a score far above every sampled one (an E may even be infinite);
# the caller decodes such input again. Below that bound every E and every product with a value
# under 2^60 stays inside fp32 (E v sums at most 2^64 * 2^60).
EXP_SCORES_SAMPLED_KEYS = 1024
EXP_SCORES_TRIP_LOG2 = 64


def exp_scores_attention_unsupported(q: torch.Tensor, k: torch.Tensor,
                                     v: torch.Tensor) -> str | None:
    """Why ``attention_exp_scores`` cannot take these tokens; None if it can."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "attention takes (N, L, d) tokens"
    if v.shape[:2] != k.shape[:2] or v.dtype != q.dtype or v.device != q.device:
        return "values differ from the keys in batch, tokens, dtype or device"
    return exp_scores_unsupported(q, k)


def exp_scores_chunk_size(batch: int, q_len: int, k_len: int, budget_bytes: int = 1 << 30) -> int:
    """Query rows per chunk so one chunk's E (bf16) fits ``budget_bytes``: the one
    score-sized tensor alive, where the softmax path's count holds two (so twice its budget)."""
    return attention_chunk_size(batch, q_len, k_len, torch.bfloat16, 2 * budget_bytes)


def attention_exp_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         tripped: torch.Tensor, chunk: int | None = None, *,
                         budget_bytes: int = 1 << 30) -> torch.Tensor | None:
    """``softmax(q k^T) v`` over bf16 tokens (N, L, d), scale folded into ``q``, as
    ``(E v) / rowsum(E)`` with ``E = exp(q k^T - ref)`` written by ``exp_scores``; by chunks of
    query rows. None, nothing computed, where ``exp_scores_attention_unsupported`` says why.

    ``ref`` per row is its best score among the sampled keys (the note above). A row whose sum
    says a score lies far above them is not repaired here: ``tripped`` (a bool tensor on the
    device) is set, without a host sync, and the caller decides (the KL decoder decodes again
    on the softmax path). Values agree with the softmax path up to rounding: E is rounded once to bf16
    like the probabilities, the product with ``v`` accumulates in fp32 and is divided once.
    """
    if exp_scores_attention_unsupported(q, k, v) is not None:
        return None
    n, lq, _ = q.shape
    lk = k.shape[1]
    if chunk is None:
        chunk = exp_scores_chunk_size(n, lq, lk, budget_bytes)
    chunk = max(1, min(int(chunk), lq))
    sampled = k[:, ::max(1, lk // EXP_SCORES_SAMPLED_KEYS)].transpose(1, 2)
    most_sum = 2.0 ** EXP_SCORES_TRIP_LOG2
    out = torch.empty(n, lq, v.shape[2], dtype=v.dtype, device=v.device)
    for start in range(0, lq, chunk):
        qc = q[:, start:start + chunk]
        ref = torch.matmul(qc, sampled).amax(-1).float()
        e, sums = exp_scores(qc, k, ref)
        # NaN and inf trip too (not <=).
        torch.logical_or(tripped, (~(sums <= most_sum)).any(), out=tripped)
        out[:, start:start + chunk] = _matmul_fp32(e, v).div_(sums[..., None])
        del e
    return out


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T) v`` over tokens (N, L, d) with torch SDPA, scale 1 (pre-folded).

    A head axis is added because SDPA's fused CUDA kernels take only 4-D (N, heads, L, d)
    inputs (3-D falls back to the math kernel). d = 512 is beyond the flash kernel's limit, so
    CUDA picks the memory-efficient (or cuDNN) kernel: the stock path's kernel.
    """
    out = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), scale=1.0)
    return out.squeeze(1)


def attn_block_reference(
    x: torch.Tensor,
    h_normed: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
) -> torch.Tensor:
    """The unfolded stock block after its norm, in plain torch: four projections, attention
    with scale ``1/sqrt(C)``, ``x + proj_out(...)``. (N, C, H, W) in and out."""
    height, width = x.shape[-2:]

    def conv1x1(w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, _matrix(w)[:, :, None, None], b)

    q, k, v = (to_tokens(conv1x1(w, b, h_normed)) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    probs = torch.softmax(torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), dim=-1)
    attended = from_tokens(torch.matmul(probs, v).contiguous(), height, width)
    return x + conv1x1(wo, bo, attended)


def folded_attn_block_reference(
    x: torch.Tensor,
    h_normed: torch.Tensor,
    folded: FoldedAttention,
    chunk: int | None = None,
) -> torch.Tensor:
    """The folded block after its norm: ``x + attention(q', h, v') + out_bias``.

    Equal to ``attn_block_reference`` up to rounding; its memory layout follows torch's
    elementwise rules for ``x`` plus a channels-last tensor."""
    height, width = h_normed.shape[-2:]
    tokens = to_tokens(h_normed)
    q = F.linear(tokens, folded.query_weight, folded.query_bias)
    v = F.linear(tokens, folded.value_weight)
    attended = attention_chunked(q, tokens, v, chunk)
    attended = attended + folded.out_bias
    return x + from_tokens(attended, height, width)


__all__ = [
    "FoldedAttention",
    "attention_chunk_size",
    "attention_chunked",
    "attention_exp_scores",
    "attention_sdpa",
    "attn_block_reference",
    "exp_scores_attention_unsupported",
    "exp_scores_chunk_size",
    "fold_attention_weights",
    "folded_attn_block_reference",
    "from_tokens",
    "to_tokens",
]
