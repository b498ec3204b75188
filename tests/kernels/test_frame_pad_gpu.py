"""frame_pad on a GPU.

Tier 3 (``cuda``): an output whose element offsets exceed int32. The kernel against its twin on
small shapes under TRITON_INTERPRET is tier 1, in test_frame_pad.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.frame_pad import frame_pad, frame_pad_unsupported


@pytest.mark.cuda
def test_offsets_beyond_int32_on_the_gpu():
    # 128 x 6 x 2051 x 2051 output elements > 2^31: int32 offsets would wrap.
    x = torch.randn((1, 128, 4, 2049, 2049), device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    assert frame_pad_unsupported(x, None, 2, 0, 1, 1) is None
    out = frame_pad(x, None, 2, 0, 1, 1)
    assert out.numel() > 2**31
    # Reflect: output row/column 0 reads 1, the last reads H - 2; the front frames copy x[0].
    assert torch.equal(out[0, :, 0, 0, 0], x[0, :, 0, 1, 1])
    assert torch.equal(out[0, :, -1, -1, -1], x[0, :, -1, -2, -2])
    assert torch.equal(out[0, :, 3, 1:-1, 1:-1], x[0, :, 1])
