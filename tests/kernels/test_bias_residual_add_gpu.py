"""bias_residual_add_ (Triton, channels-last, in place) on a GPU.

Tier 3 (``cuda``): a tensor whose element offsets exceed int32. The kernel against its
plain-torch reference on small shapes under TRITON_INTERPRET is tier 1, in
test_bias_residual_add.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.bias_residual_add import bias_residual_add_


@pytest.mark.cuda
def test_offsets_beyond_int32_on_the_gpu():
    # 2^31 + a few elements: int32 offsets would wrap and write the wrong pixels.
    shape = (1, 128, 4097, 4097)
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16,
                      memory_format=torch.channels_last).zero_()
    bias = torch.arange(128, device="cuda", dtype=torch.bfloat16)
    assert bias_residual_add_(out, bias, None) is out
    last = out[0, :, -1, -1]
    assert torch.equal(last, bias) and torch.equal(out[0, :, 0, 0], bias)
