"""Folded single-head VAE attention and chunked attention (tier 1, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from fast_vae_decode.kernels.vae_attention import (
    attention_chunk_size,
    attention_chunked,
    attention_sdpa,
    attn_block_reference,
    fold_attention_weights,
    folded_attn_block_reference,
    from_tokens,
    to_tokens,
)

C = 64  # small stand-in for the real 512: same algebra, fast on 2 CI cores
N, H, W = 2, 7, 9  # N > 1 and 63 tokens: odd, non-square, not a multiple of any chunk below


def _weights(dtype, seed=0, channels=C):
    """Random 1x1 conv weights with non-zero biases (biases are what the fold rewrites)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(4):
        w = torch.randn(channels, channels, 1, 1, generator=g, dtype=torch.float64)
        out += [
            (w / math.sqrt(channels)).to(dtype),
            torch.randn(channels, generator=g, dtype=torch.float64).to(dtype),
        ]
    return out  # wq, bq, wk, bk, wv, bv, wo, bo


def _inputs(dtype, seed=1, channels=C):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, channels, H, W, generator=g, dtype=torch.float64)
    h = torch.randn(N, channels, H, W, generator=g, dtype=torch.float64)
    return x.to(dtype), h.to(dtype)


def _plain_attention(q, k, v):
    return torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v


def test_query_fold_changes_logits_by_a_per_row_constant_only():
    # Checks the orientation of A (= Wq^T Wk, used as q' = A^T h + c) directly on the logits.
    wq, bq, wk, bk, *_ = _weights(torch.float64)
    _, h = _inputs(torch.float64)
    t = to_tokens(h)
    q = t @ wq[:, :, 0, 0].T + bq
    k = t @ wk[:, :, 0, 0].T + bk
    stock = q @ k.transpose(1, 2) / math.sqrt(C)
    folded = fold_attention_weights(*_weights(torch.float64))
    ours = (t @ folded.query_weight.T + folded.query_bias) @ t.transpose(1, 2)
    diff = stock - ours
    # fp64, |logits| ~ 10: rounding is ~1e-14; a wrong transpose leaves O(1) spread per row.
    assert (diff - diff[:, :, :1]).abs().max() < 1e-11


@pytest.mark.parametrize("chunk", [None, 5])  # 5 does not divide 63 tokens
def test_folded_block_equals_stock_block_fp64(chunk):
    weights = _weights(torch.float64)
    x, h = _inputs(torch.float64)
    expected = attn_block_reference(x, h, *weights)
    got = folded_attn_block_reference(x, h, fold_attention_weights(*weights), chunk=chunk)
    # fp64 (unit roundoff 1.1e-16); outputs ~ O(3), sums of <= 64 terms re-associated by the
    # fold: rounding is ~1e-14. Any algebra slip (dropped bias, transposed A) is O(0.1) or more.
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-11)


def test_folded_block_equals_stock_block_fp32():
    weights = _weights(torch.float32)
    x, h = _inputs(torch.float32)
    expected = attn_block_reference(x.double(), h.double(), *(w.double() for w in weights))
    got = folded_attn_block_reference(x, h, fold_attention_weights(*weights))
    assert got.dtype == torch.float32
    # fp32 unit roundoff 6e-8; logits ~10 carry ~64 * 6e-8 * 10 ~ 4e-5 absolute error at worst,
    # which moves probabilities by that relative amount; outputs are O(3). 1e-4 leaves margin
    # and is still ~1000x below what a wrong fold produces.
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_fold_ignores_key_bias_and_handles_missing_biases():
    wq, bq, wk, bk, wv, bv, wo, bo = _weights(torch.float64)
    x, h = _inputs(torch.float64)
    a = fold_attention_weights(wq, bq, wk, bk, wv, bv, wo, bo)
    b = fold_attention_weights(wq, bq, wk, None, wv, bv, wo, bo)
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    expected = attn_block_reference(x, h, wq, None, wk, None, wv, None, wo, None)
    got = folded_attn_block_reference(
        x, h, fold_attention_weights(wq, None, wk, None, wv, None, wo, None)
    )
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-11)  # fp64, as above


def test_fold_accepts_linear_weights_and_casts():
    weights = _weights(torch.float64)
    linear = [w[:, :, 0, 0] if w.dim() == 4 else w for w in weights]
    a = fold_attention_weights(*weights, dtype=torch.bfloat16)
    b = fold_attention_weights(*linear, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in a)
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    assert a.query_weight.shape == a.value_weight.shape == (C, C)
    assert a.query_bias.shape == a.out_bias.shape == (C,)


def _tokens(seed, dtype=torch.float32, length=H * W):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(N, length, C, generator=g, dtype=torch.float64) for _ in range(3))
    q = q / math.sqrt(C)  # scale pre-folded, as the folded block gives it: logits ~ N(0, 1)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("chunk", [1, 5, 10, 62, 63, 64])  # 5, 10, 62 leave a ragged last chunk
def test_chunked_equals_unchunked(chunk):
    q, k, v = _tokens(2)
    exact = _plain_attention(q.double(), k.double(), v.double())
    # fp32 (unit 6e-8): logits |s| <~ 4 from 64-term sums carry <~ 2e-5 error, outputs are O(1)
    # averages. Chunks are not bitwise equal to one GEMM on CPU (BLAS blocking depends on the
    # row count), so each is held to the same bound against fp64.
    for got in (attention_chunked(q, k, v, chunk), attention_chunked(q, k, v, H * W)):
        torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)


def test_budget_picks_the_chunk():
    # 2048^2 mid-block: 65536 keys. 1 GiB over bf16 scores + bf16 probs (4 B per element):
    # 2**30 / (65536 * 4) = 4096 rows; with fp32 scores + fp32 probs + bf16 cast (10 B): 1638.
    assert attention_chunk_size(1, 65536, 65536, torch.bfloat16) == 4096
    assert attention_chunk_size(1, 65536, 65536, torch.bfloat16, fp32_scores=True) == 1638
    assert attention_chunk_size(2, 10, 10, torch.float32, budget_bytes=1) == 1  # never 0
    assert attention_chunk_size(1, 10, 10, torch.float32) == 10  # never past the query count
    q, k, v = _tokens(3)
    # A budget of 3 rows' worth (N * 63 keys * 8 bytes of fp32 scores + probs per row):
    # chunk 3, so 21 chunks.
    tiny = attention_chunked(q, k, v, budget_bytes=3 * N * H * W * 8)
    exact = _plain_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(tiny.double(), exact, rtol=1e-4, atol=1e-4)  # as above


def test_sdpa_matches_chunked():
    q, k, v = _tokens(4, torch.float64)
    # fp64 both ways; only summation order differs.
    torch.testing.assert_close(
        attention_sdpa(q, k, v), attention_chunked(q, k, v, 7), rtol=1e-11, atol=1e-11
    )


@pytest.mark.parametrize("fp32_scores", [False, True])
def test_bf16_chunked_close(fp32_scores):
    qb, kb, vb = _tokens(5, torch.bfloat16)
    exact = _plain_attention(qb.double(), kb.double(), vb.double())
    got = attention_chunked(qb, kb, vb, 10, fp32_scores=fp32_scores)
    assert got.dtype == torch.bfloat16
    # Against exact math on the same bf16 inputs: logits rounded to bf16 (unit 2^-9, |s| <~ 4)
    # shift probabilities by <~ 1%, probabilities and output rounded once each (2^-9); outputs
    # are averages of O(1) values, so 0.05 absolute is a loose but meaningful bound.
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.05)


def test_fp32_scores_are_more_accurate_in_bf16():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 256, C, generator=g).bfloat16() for _ in range(3))
    q = q * 0.5  # larger logits (~4 std) make bf16 score rounding visible
    exact = _plain_attention(q.double(), k.double(), v.double())
    err = [
        (attention_chunked(q, k, v, 64, fp32_scores=f).double() - exact).abs().mean()
        for f in (False, True)
    ]
    assert err[1] < err[0]


def test_tokens_are_free_views_of_channels_last():
    x = torch.randn(N, C, H, W).contiguous(memory_format=torch.channels_last)
    t = to_tokens(x)
    assert t.shape == (N, H * W, C) and t.is_contiguous() and t.data_ptr() == x.data_ptr()
    back = from_tokens(t, H, W)
    assert back.data_ptr() == x.data_ptr() and back.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back, x)
    # Token order is row-major over (H, W), the order the stock block flattens in.
    assert torch.equal(t[1, 2 * W + 3], x[1, :, 2, 3])


@pytest.mark.parametrize("fp32_scores", [False, True])
def test_chunked_softmax_is_the_row_kernel_in_place_where_it_runs(monkeypatch, fp32_scores):
    """The chunked attention hands each score chunk to ``softmax_rows`` (in place on half
    scores, into a new half tensor from fp32 ones); where it declines, torch's softmax runs;
    ``row_softmax=False`` never asks it. Each way the result is the attention."""
    from fast_vae_decode.kernels import vae_attention

    qb, kb, vb = _tokens(7, torch.bfloat16)
    exact = _plain_attention(qb.double(), kb.double(), vb.double())
    real = vae_attention.softmax_rows
    for decline in (False, True):
        asked = []

        def spy(scores, out=None, scale=1.0, asked=asked, decline=decline):
            asked.append(out is scores)
            return None if decline else real(scores, out=out, scale=scale)

        monkeypatch.setattr(vae_attention, "softmax_rows", spy)
        got = attention_chunked(qb, kb, vb, 10, fp32_scores=fp32_scores)
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.05)  # as test_bf16_chunked_close
        assert len(asked) == 7 and all(a == (not fp32_scores) for a in asked)  # 63 rows, chunks of 10
        asked.clear()
        attention_chunked(qb, kb, vb, 10, fp32_scores=fp32_scores, row_softmax=False)
        assert asked == []


# --- exp_scores attention ---------------------------------------------------------------------


@pytest.fixture
def small_exp_scores(monkeypatch):
    """Interpreter-sized tiles, and few sampled keys so the tests meet unsampled ones."""
    from fast_vae_decode.kernels import exp_scores, vae_attention

    monkeypatch.setattr(exp_scores, "EXP_SCORES_CONFIG",
                        exp_scores.ExpScoresConfig(16, 32, 16, 4, 1))
    monkeypatch.setattr(vae_attention, "EXP_SCORES_SAMPLED_KEYS", 8)


@pytest.mark.parametrize("chunk", [None, 10])  # one chunk; 63 rows in chunks of 10 (ragged last)
def test_exp_scores_attention_is_the_attention(small_exp_scores, chunk):
    from fast_vae_decode.kernels.vae_attention import attention_exp_scores

    qb, kb, vb = _tokens(7, torch.bfloat16)
    exact = _plain_attention(qb.double(), kb.double(), vb.double())
    tripped = torch.zeros((), dtype=torch.bool)
    got = attention_exp_scores(qb, kb, vb, tripped, chunk)
    assert got.dtype == torch.bfloat16 and got.shape == vb.shape[:2] + (C,)
    # The bf16 chunked softmax's own bound (test_bf16_chunked_close); measured ~8e-3 here.
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.05)
    assert not tripped


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's exp2
def test_exp_scores_attention_trips_on_a_score_far_above_the_sampled_ones(small_exp_scores):
    """One unsampled key aligned with a query at a huge score: that row's E overflows past the
    trip bound. The flag is set on the device (no exception, no host check); the other rows
    and a decode without the outlier stay untripped."""
    from fast_vae_decode.kernels import vae_attention

    qb, kb, vb = _tokens(8, torch.bfloat16)
    stride = kb.shape[1] // vae_attention.EXP_SCORES_SAMPLED_KEYS
    assert stride > 1  # key 1 is not sampled
    tripped = torch.zeros((), dtype=torch.bool)
    vae_attention.attention_exp_scores(qb, kb, vb, tripped)
    assert not tripped
    far = kb.clone()
    far[0, 1] = (qb[0, 5].float() / qb[0, 5].float().norm() * 200).bfloat16()  # score ~ +200 |q|
    vae_attention.attention_exp_scores(qb, far, vb, tripped)
    assert tripped
    still = torch.ones((), dtype=torch.bool)  # an OR: a set flag stays set
    vae_attention.attention_exp_scores(qb, kb, vb, still)
    assert still


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exp_scores_attention_takes_bf16_only(dtype):
    from fast_vae_decode.kernels.vae_attention import (
        attention_exp_scores,
        exp_scores_attention_unsupported,
    )

    q, k, v = _tokens(9, dtype)
    tripped = torch.zeros((), dtype=torch.bool)
    assert "bf16" in exp_scores_attention_unsupported(q, k, v)
    assert attention_exp_scores(q, k, v, tripped) is None and not tripped


def test_exp_scores_chunks_hold_one_score_tensor():
    from fast_vae_decode.kernels.vae_attention import exp_scores_chunk_size

    # SDXL 2048²'s mid-block: 65536 keys; 1 GiB holds 8192 rows of bf16 E (the softmax path's
    # 4096 rows hold scores and probabilities).
    assert exp_scores_chunk_size(1, 65536, 65536) == 8192
    assert attention_chunk_size(1, 65536, 65536, torch.bfloat16) == 4096
    assert exp_scores_chunk_size(2, 100, 7, budget_bytes=1) == 1
