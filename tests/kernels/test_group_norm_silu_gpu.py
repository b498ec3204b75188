"""group_norm_silu (Triton, channels-last) against its plain-torch reference on a GPU.

Tier 3 (``cuda``): real VAE sizes, including one tensor whose per-sample offsets exceed int32.
Small shapes under TRITON_INTERPRET, and the reference against torch's own GroupNorm, are
tier 1, in test_group_norm_silu.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.bias_residual_add import bias_residual_add_
from fast_vae_decode.kernels.group_norm_silu import (
    add_bias_residual_group_stats_,
    group_norm_silu,
    group_norm_silu_reference,
)
from support.group_norm_silu_inputs import EPS, TOL, _affine, _check, _input

# On the GPU, groups hold 10^5..10^6 elements summed in different orders (the reference's
# var_mean vs the kernel's split Welford): fp32 statistics then agree to ~1e-6 relative, so fp32
# outputs to ~1e-5; 1e-4 leaves margin while still catching any indexing error (order 1).
GPU_TOL = {**TOL, torch.float32: (1e-4, 1e-4)}


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 512, 128, 128, 32), torch.bfloat16),  # SDXL/Flux 1024² mid block and first up block
        ((1, 128, 1024, 1024, 32), torch.bfloat16),  # SDXL 1024² last up block (1M-element groups)
        ((2, 256, 256, 256, 32), torch.float16),  # batch 2
        ((1, 320, 64, 64, 32), torch.float32),  # group width 10 (membership mask), fp32
    ],
    ids=["512x128", "128x1024", "2x256x256", "320x64-fp32"],
)
def test_gpu_matches_reference(shape, dtype):
    n, c, h, w, g = shape
    x = _input(n, c, h, w, dtype, device="cuda")
    weight, bias = _affine(c, device="cuda", dtype=dtype)
    input_bias = torch.randn(c, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(dtype)
    with torch.inference_mode():
        _check(x, weight, bias, g, tol=GPU_TOL[dtype])
        _check(x, None, None, g, silu=False, tol=GPU_TOL[dtype])
        _check(x, weight, bias, g, tol=GPU_TOL[dtype], input_bias=input_bias)  # a conv's bias


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 512, 128, 128, 32), (1, 128, 1024, 1024, 32),
                                   (2, 256, 256, 256, 32)], ids=["512x128", "128x1024", "2x256x256"])
def test_gpu_residual_add_hands_its_statistics_to_the_norm(shape):
    """At real sizes, the handed-over statistics: the sum as ``bias_residual_add_`` writes it
    (same rounding on the GPU), and the norm bit-identical to the one taking its own."""
    n, c, h, w, g = shape
    with torch.inference_mode():
        out = _input(n, c, h, w, torch.bfloat16, device="cuda", seed=2)
        residual = _input(n, c, h, w, torch.bfloat16, mean=-2.0, device="cuda", seed=3)
        conv_bias = torch.randn(c, device="cuda").to(torch.bfloat16)
        expected = bias_residual_add_(out.clone(memory_format=torch.channels_last), conv_bias,
                                      residual)
        stats = add_bias_residual_group_stats_(out, conv_bias, residual, g)
        assert stats is not None and torch.equal(out, expected)
        weight, bias = _affine(c, device="cuda", dtype=torch.bfloat16)
        own = group_norm_silu(out, weight, bias, g, EPS)
        assert torch.equal(group_norm_silu(out, weight, bias, g, EPS, stats=stats), own)


@pytest.mark.cuda
def test_gpu_offsets_beyond_int32():
    # One sample of 128 x 4096 x 4112 = 2.16e9 elements > 2^31: element offsets within a sample
    # only fit int64. x and the output take 8.6 GB; the reference runs a few groups at a time.
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with >= 40 GB")
    n, c, h, w, g = 1, 128, 4096, 4112, 32
    assert c * h * w > 2**31
    torch.manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(n, h, w, c, device="cuda", dtype=torch.bfloat16).permute(0, 3, 1, 2)
        weight, bias = _affine(c, device="cuda", dtype=torch.bfloat16)
        y = group_norm_silu(x, weight, bias, g, EPS)
        assert y is not None
        rtol, atol = TOL[torch.bfloat16]
        cpg, step = c // g, 4  # GroupNorm is separable by groups: check 4 groups at a time
        for g0 in range(0, g, step):
            cs = slice(g0 * cpg, (g0 + step) * cpg)
            ref = group_norm_silu_reference(x[:, cs], weight[cs], bias[cs], step, EPS)
            torch.testing.assert_close(y[:, cs], ref, rtol=rtol, atol=atol)
            del ref


@pytest.mark.cuda
@pytest.mark.parametrize("shape,dtype", [((1, 128, 1024, 1024, 32), torch.bfloat16),
                                         ((2, 256, 256, 256, 32), torch.float16),
                                         ((1, 320, 64, 64, 32), torch.float32)],
                         ids=["128x1024", "2x256x256-fp16", "320x64-fp32"])
def test_gpu_fast_silu_matches_reference(shape, dtype):
    """SiLU's MUFU form (``kernels.silu``) within the library form's tolerance of the
    reference, and at most one rounding step of the output dtype from the library form."""
    n, c, h, w, g = shape
    x = _input(n, c, h, w, dtype, device="cuda", mean=-3.0, seed=7)  # many SiLU tails
    weight, bias = _affine(c, device="cuda", dtype=dtype)
    with torch.inference_mode():
        fast = group_norm_silu(x, weight, bias, g, EPS, fast_silu=True)
        exact = group_norm_silu(x, weight, bias, g, EPS)
        ref = group_norm_silu_reference(x, weight, bias, g, EPS)
    rtol, atol = GPU_TOL[dtype]
    torch.testing.assert_close(fast.float(), ref.float(), rtol=rtol, atol=atol)
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(fast.float(), exact.float(), rtol=step, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 128, 1024, 1024), (4, 256, 384, 256), (1, 512, 256, 256)],
                         ids=["128x1024", "b4-256x384x256", "512x256"])
def test_gpu_out_in_a_padded_grid_is_the_dense_result(shape):
    """``out`` as a padded grid's interior at the KL route's sizes: the dense result's bits,
    the border never written."""
    from fast_vae_decode.kernels.padded_grid_conv import empty_padded

    n, c, h, w = shape
    x = _input(n, c, h, w, torch.bfloat16, device="cuda")
    weight, bias = _affine(c, device="cuda", dtype=torch.bfloat16)
    dense = group_norm_silu(x, weight, bias, 32, EPS)
    padded, interior = empty_padded((1, c, n, h, w), torch.bfloat16, x.device, bordered=False)
    padded.fill_(float("nan"))
    out = interior[0].permute(1, 0, 2, 3)
    assert group_norm_silu(x, weight, bias, 32, EPS, out=out) is out
    assert torch.equal(out, dense)
    assert bool(padded[:, :, :, 0].isnan().all() and padded[:, :, :, :, 0].isnan().all())
