"""exp_scores (the score GEMM that writes unnormalised probabilities) against its plain-torch
twin.

Tier 1: the kernel under TRITON_INTERPRET on small shapes with small tiles. (Tier 3, the KL
mid-block's real sizes and an output past 2^31 elements, is in test_exp_scores_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.exp_scores import (
    MAX_KEYS,
    ExpScoresConfig,
    exp_scores,
    exp_scores_reference,
    exp_scores_unsupported,
    tma_unavailable_reason,
)

SMALL = ExpScoresConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1)
# The persistent TMA kernel at the same tiles (under the interpreter: 4 programs, each walking
# several tiles, so the flattened tile loop is exercised).
SMALL_TMA = SMALL._replace(tma=True)

SHAPES = [
    (1, 16, 32, 16),  # (batch, queries, keys, channels): exactly one tile
    (1, 5, 7, 24),  # ragged in every dim; channels not a multiple of 16 (masked K tail)
    (2, 33, 70, 40),  # batch 2, several tiles each way with ragged last ones
]
# Shapes the TMA kernel takes (16-byte rows): ragged query and key tiles, a K tail of 8
# channels (40 = 2 x 16 + 8), batch 2 (one launch per sample), more tiles than programs.
TMA_SHAPES = [
    (1, 16, 32, 16),
    (2, 33, 72, 40),
    (1, 70, 200, 16),
]


def _qk(batch, lq, lk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, lq, d, generator=g) / d ** 0.5 * 3).bfloat16()
    k = torch.randn(batch, lk, d, generator=g).bfloat16()
    return q, k


def _ref_rows(q, k, shift=-1.5):
    """A reference a little under each row's best score (the row's largest E ~ e^1.5)."""
    return ((q.float() @ k.float().transpose(1, 2)).amax(-1) + shift).contiguous()


@pytest.mark.parametrize("shape", SHAPES)
def test_exp_scores_matches_its_twin(shape):
    q, k = _qk(*shape)
    ref = _ref_rows(q, k)
    e, sums = exp_scores(q, k, ref, SMALL)
    expected_e, expected_sums = exp_scores_reference(q, k, ref)
    assert e.shape == shape[:3] and e.dtype == torch.bfloat16 and e.is_contiguous()
    # exp2 of a pre-scaled score against exp: at most one bf16 rounding step apart.
    torch.testing.assert_close(e.float(), expected_e.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums, expected_sums, rtol=2 ** -7, atol=0)  # as the values
    # The sums are of the values written: the division by them normalises exactly those.
    torch.testing.assert_close(sums, e.float().sum(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", TMA_SHAPES)
def test_the_tma_kernel_matches_the_twin(shape):
    q, k = _qk(*shape)
    assert tma_unavailable_reason(q, k) is None
    ref = _ref_rows(q, k)
    e, sums = exp_scores(q, k, ref, SMALL_TMA)
    expected_e, expected_sums = exp_scores_reference(q, k, ref)
    assert e.shape == shape[:3] and e.is_contiguous()
    torch.testing.assert_close(e.float(), expected_e.float(), rtol=2 ** -7, atol=0)
    # Keys past the last (zero-filled by TMA, so E = exp(-ref) there) stay out of the sums.
    torch.testing.assert_close(sums, e.float().sum(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(sums, expected_sums, rtol=2 ** -7, atol=0)


def test_the_tma_kernel_reads_row_views_in_place():
    q_all, k = _qk(2, 40, 64, 24, seed=3)
    q = q_all[:, 8:29]  # 8 rows of 48 bytes in: still 16-byte aligned
    assert tma_unavailable_reason(q, k) is None
    ref = _ref_rows(q, k)
    e, sums = exp_scores(q, k, ref, SMALL_TMA)
    expected_e, expected_sums = exp_scores_reference(q, k, ref)
    torch.testing.assert_close(e.float(), expected_e.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums, expected_sums, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("make, needle", [
    (lambda q, k: (q, k[:, :7]), "keys"),  # E's rows of 14 bytes
    (lambda q, k: (q[:, :, 1:], k[:, :, 1:]), "aligned"),  # rows start 2 bytes in
])
def test_unaligned_tensors_take_the_pointer_kernel(make, needle):
    q, k = make(*_qk(1, 16, 32, 16))
    assert needle in tma_unavailable_reason(q, k)
    ref = _ref_rows(q, k)
    e, sums = exp_scores(q, k, ref, SMALL_TMA)
    expected_e, expected_sums = exp_scores_reference(q, k, ref)
    torch.testing.assert_close(e.float(), expected_e.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums, expected_sums, rtol=2 ** -7, atol=0)


def test_the_warm_up_call_compiles_the_tma_variant_every_size_runs():
    """The KL attention's warm-up calls exp_scores on 16 tokens; a 2048² decode's chunks are
    8192 x 65536. Both must be the same compiled variant of the TMA kernel."""
    from fast_vae_decode.kernels.backend import recording_launches, variant_key

    records = []
    for lq, lk in ((16, 16), (70, 200), (33, 72)):
        q, k = _qk(1, lq, lk, 16)
        with recording_launches() as recorded:
            exp_scores(q, k, _ref_rows(q, k), SMALL_TMA)
        assert len(recorded) == 1
        records.append(recorded[0])
    assert len({variant_key(r) for r in records}) == 1


def test_exp_scores_reads_row_views_in_place():
    # The attention hands each chunk of query rows as a view of the whole (no copy) and the
    # keys as the tokens' view: strided batches.
    q_all, k = _qk(2, 40, 50, 24, seed=3)
    q = q_all[:, 8:29]
    assert not q.is_contiguous()
    ref = _ref_rows(q, k)
    e, sums = exp_scores(q, k, ref, SMALL)
    expected_e, expected_sums = exp_scores_reference(q, k, ref)
    torch.testing.assert_close(e.float(), expected_e.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums, expected_sums, rtol=2 ** -7, atol=0)  # as the values


def test_a_reference_above_the_scores_keeps_the_relative_values():
    # Any reference gives the same probabilities once divided by the sums, while the largest E
    # stays in bf16's normal range (here about e^-40).
    q, k = _qk(1, 9, 33, 16, seed=4)
    e, sums = exp_scores(q, k, _ref_rows(q, k, shift=40.0), SMALL)
    probs = torch.softmax(q.float() @ k.float().transpose(1, 2), -1)
    torch.testing.assert_close(e.float() / sums[..., None], probs, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("make, needle", [
    (lambda q, k, r: (q.half(), k.half(), r), "bf16"),  # fp16's range is too narrow for ref
    (lambda q, k, r: (q.float(), k.float(), r), "bf16"),
    (lambda q, k, r: (q, k[..., :8], r), "channels"),
    (lambda q, k, r: (q, k[:1], r), "batch"),
    (lambda q, k, r: (q, k, r[:, :3]), "ref"),
    (lambda q, k, r: (q, k, r.double()), "ref"),
    (lambda q, k, r: (q.transpose(1, 2), k, r), "contiguous"),
    (lambda q, k, r: (q.requires_grad_(), k, r), "autograd"),
    # int32 offsets inside a tile: a broadcast view stands for that many keys (no memory)
    (lambda q, k, r: (q, k[:, :1].expand(2, MAX_KEYS + 1, 16), r), "keys"),
])
def test_exp_scores_declines_what_it_cannot_take(make, needle):
    q, k = _qk(2, 16, 16, 16)
    q, k, ref = make(q, k, _ref_rows(q, k))
    with torch.enable_grad():
        reason = exp_scores_unsupported(q, k, ref)
        assert reason is not None and needle in reason
        assert exp_scores(q, k, ref, SMALL) is None
