"""``rms_norm_exact``: ComfyUI's Wan RMS norm tail in one pass, bit for bit (what lossless uses).

Tier 3 (``cuda``): every dtype at a Wan 2.1 full-resolution size. The interpreter runs (fp32 and
fp16 against the stock formula; bf16 declined there) and the install-time check are tier 1, in
test_rms_norm_exact.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.rms_norm_exact import rms_norm_exact, rms_norm_exact_reference
from support.rms_norm_exact_inputs import _inputs, _same


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_the_stock_formula_at_wan_size(dtype):
    # Wan 2.1's largest norm input: 96 channels, 4 frames at 480x832 (153M elements).
    x, gamma, _ = _inputs((1, 96, 4, 480, 832), dtype, zero_pixels=False)
    x, gamma = x.cuda(), gamma.cuda()
    got = rms_norm_exact(x, gamma, None, 96 ** 0.5)
    assert got is not None and _same(got, rms_norm_exact_reference(x, gamma, None, 96 ** 0.5))
