"""``accepts.pixels_dense``: its channels-last shortcut (torch's own C++ test, taken first on
every launch's checks for host time) answers as the stride walk that defines the predicate, on
the layouts the decoders hand it and on odd views of them."""
from __future__ import annotations

import itertools

import pytest
import torch

from fast_vae_decode.kernels.accepts import pixels_dense
from fast_vae_decode.kernels.accepts import pixels_dense_by_strides as _stride_walk


def _views():
    for shape in [(2, 3, 4, 5), (1, 8, 1, 6), (3, 1, 2, 2), (2, 4, 3, 2, 5), (1, 96, 1, 4, 4)]:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        dense = torch.empty(shape).contiguous(memory_format=fmt)
        yield "channels-last", dense
        yield "contiguous (NCHW)", torch.empty(shape)
        # A time or row slice keeps dense samples but not a dense batch (the walk's reason to
        # ignore the batch stride); a channel slice breaks the pixel rows.
        yield "slice of dim 2", dense[:, :, 1:]
        yield "slice of the last dim", dense[..., 1:]
        yield "slice of channels", dense[:, 1:]
        yield "batch step", dense[::2]
        # Padded-grid interiors (rows further apart than W pixels).
        big = torch.empty(shape[:-2] + (shape[-2] + 2, shape[-1] + 2)).contiguous(memory_format=fmt)
        yield "grid interior", big[..., 1:-1, 1:-1]
        for perm in itertools.permutations(range(1, len(shape))):
            yield f"permuted {perm}", torch.empty(shape).permute(0, *perm).contiguous().permute(
                0, *[perm.index(i) + 1 for i in range(1, len(shape))])
    yield "2-D", torch.empty(3, 4)
    yield "3-D transposed", torch.empty(2, 3, 4).transpose(1, 2)


@pytest.mark.parametrize("name,x", list(_views()), ids=lambda v: v if isinstance(v, str) else "")
def test_pixels_dense_matches_the_stride_walk(name, x):
    assert pixels_dense(x) == _stride_walk(x), (name, tuple(x.shape), x.stride())


def test_the_decoders_layouts():
    # What every fused decode checks: channels-last(-3d) activations are dense, NCHW is not.
    assert pixels_dense(torch.empty(1, 96, 2, 6, 8).contiguous(memory_format=torch.channels_last_3d))
    assert pixels_dense(torch.empty(4, 128, 6, 8).contiguous(memory_format=torch.channels_last))
    assert not pixels_dense(torch.empty(4, 128, 6, 8))
