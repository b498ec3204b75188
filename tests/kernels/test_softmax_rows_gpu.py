"""softmax_rows (the KL attention's in-place row softmax) on a GPU.

Tier 3 (``cuda``): the chunked attention's real score chunks against torch's softmax, the
two-pass kernel on rows past ``ONE_PASS_MAX``, and offsets past 2^31 elements. Small shapes
under TRITON_INTERPRET are tier 1, in test_softmax_rows.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.softmax_rows import ONE_PASS_MAX, softmax_rows, softmax_rows_reference

# (batch, query rows, keys): score chunks of the KL mid-block attention (attention_chunk_size).
SHAPES = [
    (1, 4096, 65536),  # SDXL / Flux 2048²
    (1, 16384, 16384),  # SDXL / Flux 1024²
    (4, 4096, 6144),  # SD1.5 768x512, batch 4
    (1, 64, ONE_PASS_MAX + 4097),  # past the one-pass limit: two passes, a ragged last block
]


def _scores(shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Logits of a few units, as the folded attention's are; bf16 as the fast path keeps them.
    return (torch.randn(shape, device="cuda", generator=g) * 3).to(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
def test_real_chunks_match_torch(shape):
    s = _scores(shape)
    expected = softmax_rows_reference(s)
    assert softmax_rows(s) is s
    # Both are fp32 math rounded once to bf16 (2^-9 relative): at most one bf16 step apart.
    torch.testing.assert_close(s.float(), expected.float(), rtol=2 ** -7, atol=1e-7)


@pytest.mark.cuda
def test_offsets_beyond_int32_on_the_gpu():
    # 32769 rows x 65536 keys = 2^31 + 65536 elements: int32 offsets would wrap in the last row.
    rows, keys = 32769, 65536
    s = _scores((1, rows, keys), seed=1)
    tail = softmax_rows_reference(s[:, -3:])
    softmax_rows(s)
    torch.testing.assert_close(s[:, -3:].float(), tail.float(), rtol=2 ** -7, atol=1e-7)
