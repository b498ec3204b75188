"""``kernels.rms_norm_silu``: the fused Triton kernel vs its reference on a GPU.

Tier 3 (``cuda``): the sizes of a Wan 2.1 480x832 decode. Small shapes under
``TRITON_INTERPRET=1``, the reference vs the stock Wan ``RMS_norm`` formula, and the inputs the
kernel must refuse are tier 1, in test_rms_norm_silu.py.
"""

from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.rms_norm_silu import rms_norm_silu, rms_norm_silu_reference
from support.rms_norm_silu_inputs import _channels_last

CUDA_CASES = [
    ((1, 96, 4, 480, 832), torch.bfloat16),  # Wan 2.1 decoder, full resolution: 153M elements
    ((1, 384, 1, 60, 104), torch.bfloat16),  # Wan 2.1 decoder, latent resolution
    ((1, 1024, 1, 60, 104), torch.bfloat16),  # Wan 2.2 widest channels
    ((1, 96, 4, 480, 832), torch.float32),  # fp32 decode precision
    ((4, 384, 60, 104), torch.float16),  # 4-D attention-block norm, frames as batch, fp16
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype", CUDA_CASES)
def test_cuda_real_sizes(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _channels_last(torch.randn(shape, generator=gen, device="cuda").to(dtype))
    channels, ndim = shape[1], len(shape)
    gamma = (1.0 + 0.5 * torch.randn(channels, generator=gen, device="cuda")).reshape(
        (channels,) + (1,) * (ndim - 2)
    )
    bias = 0.3 * torch.randn_like(gamma)
    out = rms_norm_silu(x, gamma, bias)
    assert out is not None
    ref = rms_norm_silu_reference(x, gamma, bias)
    # As in tier 1: one rounding of an fp32 result each, so at most one ulp of dtype apart
    # (bf16 2**-7, fp16 2**-10 of the binade); fp32 differs only by reduction order.
    rtol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)
