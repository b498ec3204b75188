"""``padded_grid_fill`` at Wan 2.1's routed sizes on a GPU (tier 3, ``cuda``) against its
twin: bit-exact (it only copies and zeroes), the new frames' interior and the slack rows
untouched. The small edge shapes run in tier 1, test_padded_grid_fill.py."""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import padded_grid_conv as pgc
from fast_vae_decode.kernels import padded_grid_fill as pgf

pytestmark = pytest.mark.cuda

CASES = [  # (C, frames, H, W, zero frames, cached frames)
    (96, 6, 480, 832, 0, 2),   # full resolution, 0.8's chunk of four new frames
    (96, 4, 480, 832, 0, 2),   # 0.33's piece of two
    (192, 5, 240, 416, 2, 0),  # a first chunk: zero frames in front
    (384, 3, 120, 208, 1, 1),  # one cached frame (a single new frame before it)
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_the_twin_at_real_sizes(case):
    c, t, h, w, zeros, n = case
    g = torch.Generator(device="cuda").manual_seed(0)
    front = None
    if n:
        front = torch.randn(1, c, n, h, w, generator=g, device="cuda").bfloat16()
        front = front.contiguous(memory_format=torch.channels_last_3d)
    padded, interior = pgc.empty_padded((1, c, t, h, w), torch.bfloat16, torch.device("cuda"),
                                        bordered=False)
    storage = padded.as_strided((padded.untyped_storage().nbytes() // 2,), (1,), 0)
    storage.fill_(float("nan"))
    interior[:, :, zeros + n:] = 7.0
    expected = padded.clone(memory_format=torch.channels_last_3d)
    pgf.padded_grid_fill_reference(expected, front, zeros)
    assert pgf.padded_grid_fill(padded, front, zeros)
    torch.cuda.synchronize()
    assert torch.equal(padded.nan_to_num(123.0), expected.nan_to_num(123.0))
    assert bool(storage[padded.numel():].isnan().all())
