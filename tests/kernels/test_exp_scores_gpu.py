"""exp_scores and the exp_scores attention on a GPU.

Tier 3 (``cuda``): the KL mid-block's real chunk shapes against the plain-torch twin, an output
past 2^31 elements, and the whole attention at SDXL 2048² against the chunked softmax. Small
shapes under TRITON_INTERPRET are tier 1, in test_exp_scores.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.exp_scores import exp_scores, exp_scores_reference
from fast_vae_decode.kernels.vae_attention import attention_chunked, attention_exp_scores

# (batch, query rows, keys): E chunks of the KL mid-block attention (exp_scores_chunk_size).
SHAPES = [
    (1, 8192, 65536),  # SDXL / Flux 2048²
    (2, 16384, 16384),  # two 1024² images
    (1, 100, 1000),  # ragged tiles every way
]
CHANNELS = 512


def _tokens(batch, length, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(batch, length, CHANNELS, device="cuda", generator=g) * scale).bfloat16()


def _check_rows(q, k, ref, e, sums, rows):
    expected_e, expected_sums = exp_scores_reference(q[:, rows], k, ref[:, rows])
    # exp2 of a pre-scaled score against exp: at most one bf16 step apart.
    torch.testing.assert_close(e[:, rows].float(), expected_e.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums[:, rows], expected_sums, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(sums[:, rows], e[:, rows].float().sum(-1), rtol=1e-5, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
def test_real_chunks_match_the_twin(shape):
    batch, lq, lk = shape
    q = _tokens(batch, lq, 0, scale=0.25 / CHANNELS ** 0.5 * 4)  # scores of a few units
    k = _tokens(batch, lk, 1)
    ref = torch.full((batch, lq), 2.0, device="cuda")  # the largest E about e^2
    e, sums = exp_scores(q, k, ref)
    for rows in (slice(0, 256), slice(lq - 37, lq)):  # the first tiles and the ragged last
        _check_rows(q, k, ref, e, sums, rows)


@pytest.mark.cuda
def test_offsets_beyond_int32_on_the_gpu():
    # 32769 x 65536 = 2^31 + 65536 elements of E: the last rows are addressed past 2^31.
    free, _ = torch.cuda.mem_get_info()
    if free < 8 << 30:
        pytest.skip("needs 8 GiB of free GPU memory")
    q = _tokens(1, 32769, 2, scale=0.05)
    k = _tokens(1, 65536, 3)
    ref = torch.zeros(1, 32769, device="cuda")
    e, sums = exp_scores(q, k, ref)
    assert e.numel() > 2 ** 31
    _check_rows(q, k, ref, e, sums, slice(32769 - 64, 32769))


@pytest.mark.cuda
def test_the_attention_at_2048_matches_the_chunked_softmax():
    h = _tokens(1, 65536, 4)
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(CHANNELS, CHANNELS, device="cuda", generator=g) * 0.25 / CHANNELS).bfloat16()
    q, v = h @ w, _tokens(1, 65536, 6)
    tripped = torch.zeros((), dtype=torch.bool, device="cuda")
    got = attention_exp_scores(q, h, v, tripped)
    expected = attention_chunked(q, h, v)
    assert not tripped
    rows = slice(0, 2048)
    exact = torch.softmax(q[:, rows].float() @ h.float().transpose(1, 2), -1) @ v.float()
    # At least as close to the fp32 attention as the bf16 softmax path, give or take a step.
    err = (got[:, rows].float() - exact).abs().max().item()
    err_softmax = (expected[:, rows].float() - exact).abs().max().item()
    assert err <= max(2 * err_softmax, 1e-2), (err, err_softmax)
