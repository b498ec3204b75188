"""bias_residual_add_ (Triton, channels-last, in place) against its plain-torch reference.

Tier 1 runs the kernel under TRITON_INTERPRET on small shapes; tier 3 (``cuda``) runs a tensor
whose element offsets exceed int32.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.bias_residual_add import (
    bias_residual_add_,
    bias_residual_add_reference,
    bias_residual_add_unsupported,
)

SHAPES = [
    (1, 64, 8, 8),  # KL-like: power-of-two channels, several tiles
    (2, 3, 5, 7),  # conv_out's 3 channels (tile column padded to 4), batch 2, odd pixel count
    (1, 96, 3, 5),  # channels not a power of two; fewer pixels than one tile holds
]

# The kernel and the reference both add in fp32 and round once to the output dtype, in the
# same order (out + bias, then + residual); only fp32 contraction could differ, by an ULP.
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2.0**-7, 1e-6)}


def _tensors(shape, dtype, residual, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    out = out.contiguous(memory_format=torch.channels_last)
    bias = torch.randn(shape[1], generator=g).to(device=device, dtype=dtype)
    res = None
    if residual:
        res = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        res = res.contiguous(memory_format=torch.channels_last)
    return out, bias, res


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_reference(shape, dtype, residual):
    out, bias, res = _tensors(shape, dtype, residual)
    expected = bias_residual_add_reference(out, bias, res)
    result = bias_residual_add_(out, bias, res)
    assert result is out  # in place
    assert out.is_contiguous(memory_format=torch.channels_last)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_residual_without_bias():
    out, _, res = _tensors((1, 16, 4, 4), torch.float32, True)
    expected = out + res
    assert bias_residual_add_(out, None, res) is out
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_reference_matches_torch_adds():
    out, bias, res = _tensors((1, 8, 3, 3), torch.float32, True)
    expected = out + bias.view(1, -1, 1, 1) + res
    torch.testing.assert_close(bias_residual_add_reference(out, bias, res), expected)


def test_unsupported_inputs_are_declined_untouched():
    out, bias, res = _tensors((1, 8, 4, 4), torch.float32, True)
    nchw = out.contiguous()
    before = nchw.clone()
    assert bias_residual_add_unsupported(nchw, bias, None) == "not channels-last"
    assert bias_residual_add_(nchw, bias, None) is None and torch.equal(nchw, before)
    assert "residual" in bias_residual_add_unsupported(out, bias, res.contiguous())
    assert "bias" in bias_residual_add_unsupported(out, bias[:4], None)
    assert bias_residual_add_unsupported(out, None, None) == "nothing to add"


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
