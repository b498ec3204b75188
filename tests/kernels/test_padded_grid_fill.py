"""``padded_grid_fill`` under the Triton interpreter against its twin (tier 1; real sizes in
test_padded_grid_fill_gpu.py).

The fill must write the border of every frame, the zero frames and the cached frames, and
nothing else: the new frames' interior belongs to the norm that writes it (marked here with a
sentinel), and the slack rows after the last frame stay unwritten (NaN here)."""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import padded_grid_conv as pgc
from fast_vae_decode.kernels import padded_grid_fill as pgf

SENTINEL = 7.0

# (C, frames, H, W, zero frames, cached frames, cached rows dense), each for a reason:
CASES = [
    (96, 4, 5, 7, 0, 2, True),     # the route's chunk: two cached frames, then two new ones
    (16, 3, 4, 150, 2, 0, True),   # a first chunk: zero frames only; rows longer than a block
    (8, 3, 3, 800, 1, 1, True),    # rows of four blocks: two lie wholly inside (unmasked path)
    (8, 2, 2, 300, 0, 0, True),    # new frames only (the KL route): rows of blocks, border only
    (12, 3, 2, 9, 0, 2, False),    # cached frames with strided pixels (a gather, not a run)
    (3, 3, 4, 5, 1, 1, True),      # channels not a multiple of 16 (no 16-byte runs)
    (16, 2, 1, 1, 0, 0, True),     # single-pixel frames, nothing in front: only the border
]
IDS = ["c{}-t{}-{}x{}-z{}-n{}-{}".format(*c[:6], "dense" if c[6] else "strided") for c in CASES]


def _grid(c, t, h, w, dtype):
    padded, interior = pgc.empty_padded((1, c, t, h, w), dtype, torch.device("cpu"),
                                        bordered=False)
    storage = padded.as_strided((padded.untyped_storage().nbytes() // padded.element_size(),),
                                (1,), 0)
    storage.fill_(float("nan"))
    return padded, interior, storage


def _cached(c, n, h, w, dense, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dense:
        x = torch.randn(1, c, n, h, w, generator=g)
        return x.to(dtype).contiguous(memory_format=torch.channels_last_3d)
    wide = torch.randn(1, c, n, h, 2 * w, generator=g).to(dtype)
    return wide.contiguous(memory_format=torch.channels_last_3d)[..., ::2]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_writes_border_and_front_and_nothing_else(case, dtype):
    c, t, h, w, zeros, n, dense = case
    front = _cached(c, n, h, w, dense, dtype) if n else None
    padded, interior, storage = _grid(c, t, h, w, dtype)
    interior[:, :, zeros + n:] = SENTINEL  # the producer's frames
    expected = storage.clone()
    expected_grid = padded.as_strided(padded.shape, padded.stride(), 0).clone()
    pgf.padded_grid_fill_reference(expected_grid, front, zeros)
    assert pgf.padded_grid_fill_unsupported(padded, front, zeros) is None
    assert pgf.padded_grid_fill(padded, front, zeros)
    torch.testing.assert_close(padded, expected_grid, rtol=0, atol=0, equal_nan=True)
    assert bool((interior[:, :, zeros + n:] == SENTINEL).all())
    assert bool(padded[:, :, :, 0].eq(0).all() and padded[:, :, :, :, -1].eq(0).all())
    # the slack rows after the grid are never written
    assert bool(storage[padded.numel():].isnan().all()) and storage.numel() == expected.numel()


def test_reference_is_the_assembled_causal_input():
    """What the route assembled with torch before: zero frames, then the cached frames, in
    a grid whose border is zero."""
    front = _cached(4, 2, 3, 5, True, torch.float32)
    padded, interior, _ = _grid(4, 5, 3, 5, torch.float32)
    interior[:, :, 3:] = SENTINEL
    pgf.padded_grid_fill_reference(padded, front, 1)
    assert bool((interior[:, :, :1] == 0).all())
    assert torch.equal(interior[:, :, 1:3], front)
    reference, ref_interior = pgc.empty_padded((1, 4, 5, 3, 5), torch.float32,
                                               torch.device("cpu"))
    ref_interior[:, :, 3:] = SENTINEL
    ref_interior[:, :, :1] = 0
    ref_interior[:, :, 1:3] = front
    assert torch.equal(padded, reference)


def test_fill_declines_what_it_cannot_take_and_writes_nothing():
    padded, interior, storage = _grid(8, 3, 4, 5, torch.float32)
    before = storage.clone()
    good = _cached(8, 2, 4, 5, True, torch.float32)
    declines = {
        "not a grid": (interior, good, 0),  # the interior view, not the whole grid
        "wrong frame size": (padded, _cached(8, 2, 4, 6, True, torch.float32), 0),
        "wrong channels": (padded, _cached(4, 2, 4, 5, True, torch.float32), 0),
        "too many frames": (padded, good, 2),
        "dtype": (padded, good.to(torch.float64), 0),
        "channels not innermost": (padded, good.contiguous(), 0),
    }
    for label, (grid, front, zeros) in declines.items():
        assert pgf.padded_grid_fill_unsupported(grid, front, zeros) is not None, label
        assert not pgf.padded_grid_fill(grid, front, zeros), label
    assert torch.equal(storage.isnan(), before.isnan())


def test_fill_declines_without_triton_for_the_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    padded, _, _ = _grid(8, 3, 4, 5, torch.float32)
    assert pgf.padded_grid_fill_unsupported(padded, None, 2) is not None
