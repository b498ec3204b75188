"""group_norm_silu (Triton, channels-last) against its plain-torch reference, and the reference
against torch's own GroupNorm.

Tier 1 runs the kernels under TRITON_INTERPRET on small shapes; tier 3 (``cuda``) runs real VAE
sizes on a GPU, including one tensor whose per-sample offsets exceed int32.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.kernels.group_norm_silu import (
    GroupNormSiLUConfig,
    group_norm_silu,
    group_norm_silu_reference,
    group_norm_silu_unsupported,
)

EPS = 1e-6  # what KL VAE decoders use

# (N, C, H, W, num_groups)
SHAPES = [
    (1, 64, 8, 8, 32),  # KL-like: 32 groups of a power-of-two width; HW fills whole stats tiles
    (2, 96, 5, 7, 32),  # C not a power of two (groups of 3: the membership-mask path), N=2, odd HW
    (1, 128, 3, 5, 8),  # G != 32 (8 groups of 16), HW smaller than one stats tile
    (1, 40, 6, 6, 5),  # G not a power of two: padded group rows must stay out of the statistics
    (1, 24, 4, 4, 1),  # one group (LayerNorm over C, H, W)
    (1, 16, 3, 3, 16),  # one channel per group (InstanceNorm)
    (1, 32, 1, 1, 8),  # a single pixel: each group's statistics come from its channels alone
]

# Tiny tiles and few programs: several full stats tiles plus a partial tail per program, several
# splits per sample, the finalize loop over more than one block of partials, and apply tails.
TINY = GroupNormSiLUConfig(
    stats_block_p=2, stats_programs=3, stats_warps=1,
    apply_block_p=4, apply_programs=3, apply_warps=1, finalize_block_s=2, finalize_warps=1,
)

# Kernel vs reference, per dtype, as (rtol, atol):
# - fp32: both compute in fp32 but sum in different orders and the kernel folds the affine into
#   one scale/shift per channel; outputs are O(10), so a few ULP is ~1e-6. 1e-5 leaves margin.
# - bf16/fp16: both round fp32 values that agree to ~1e-6 into the output dtype, so they differ by
#   one output ULP at most, i.e. at most 2^-7 (bf16) / 2^-10 (fp16) of the value (measured: up to
#   exactly that); rtol allows two ULPs. atol covers fp32 noise where the value is near zero.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2.0**-6, 1e-5),
    torch.float16: (2.0**-9, 1e-5),
}


def _input(n, c, h, w, dtype, mean=1.0, std=3.0, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g) * std + mean
    return x.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


def _affine(c, device="cpu", dtype=torch.float32, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(c, generator=g) * 0.5 + 1.0
    b = torch.randn(c, generator=g) * 0.5
    return w.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def _torch_group_norm(x, weight, bias, num_groups, eps, silu):
    y = F.group_norm(x.float(), num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


def _check(x, weight, bias, g, silu=True, config=None, tol=None):
    before = x.clone()
    y = group_norm_silu(x, weight, bias, g, EPS, silu, config=config)
    assert y is not None, group_norm_silu_unsupported(x, weight, bias, g)
    ref = group_norm_silu_reference(x, weight, bias, g, EPS, silu)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.permute(0, 2, 3, 1).is_contiguous()
    assert torch.equal(x, before)  # a new tensor; the input is untouched
    rtol, atol = tol or TOL[x.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol)
    return y, ref


# ---- tier 1: interpreter ------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, TINY], ids=["default", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_kernel_matches_reference(shape, dtype, config):
    n, c, h, w, g = shape
    x = _input(n, c, h, w, dtype)
    weight, bias = _affine(c, dtype=dtype)
    _check(x, weight, bias, g, config=config)


@pytest.mark.parametrize(
    "affine", ["none", "weight", "bias", "fp32-params"],
)
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "no-silu"])
def test_kernel_affine_and_silu_variants(affine, silu):
    # bf16 input: params in the input's dtype unless the case says otherwise.
    x = _input(2, 96, 5, 7, torch.bfloat16)
    w16, b16 = _affine(96, dtype=torch.bfloat16)
    weight, bias = {
        "none": (None, None),
        "weight": (w16, None),
        "bias": (None, b16),
        "fp32-params": _affine(96, dtype=torch.float32),  # dtype mismatch: the kernel upcasts
    }[affine]
    _check(x, weight, bias, 32, silu=silu, config=TINY)


def test_kernel_fp16():
    x = _input(1, 64, 6, 6, torch.float16)
    weight, bias = _affine(64, dtype=torch.float16)
    _check(x, weight, bias, 32, config=TINY)


def test_kernel_noncontiguous_params():
    x = _input(1, 64, 4, 4, torch.float32)
    weight, bias = _affine(128)
    _check(x, weight[::2], bias[1::2], 32)


# Masked-off lanes of the apply tile compute silu(shift) with shift ~ -1e4; numpy (the
# interpreter) warns on exp overflow there, the GPU returns 0; those lanes are never stored.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_large_mean_needs_welford():
    # Mean 1e4, std 1: in fp32, E[x^2] ~ 1e8 has an ULP of 8, so sum/sum-of-squares loses the
    # variance entirely, while Welford keeps it. Tolerance: the input's own ULP at 1e4 is ~1e-3
    # and the kernel's folded shift = bias - mean * scale carries fp32 rounding of ~2e4, so
    # outputs are within a few 1e-3 of exact (measured 4e-3 kernel, 1e-3 reference); 1e-2 is
    # far below the naive method's error (order 1 and more).
    n, c, h, w, g = 1, 64, 9, 9, 32
    x = _input(n, c, h, w, torch.float32, mean=1e4, std=1.0)
    weight, bias = _affine(c)
    tol = (0.0, 1e-2)
    y, ref = _check(x, weight, bias, g, config=TINY, tol=tol)
    _check(x, weight, bias, g, tol=tol)
    # The oracle here is fp64: torch's own CPU GroupNorm on a channels-last fp32 tensor uses
    # sum/sum-of-squares and is off by thousands on this input (torch 2.14).
    exact = F.silu(F.group_norm(x.double(), g, weight.double(), bias.double(), EPS))
    torch.testing.assert_close(ref, exact.float(), rtol=0.0, atol=1e-2)

    # The case discriminates: the naive fp32 statistics are far off on this input.
    grouped = x.reshape(n, g, -1)
    mean = grouped.sum(-1, keepdim=True) / grouped.shape[-1]
    var = (grouped * grouped).sum(-1, keepdim=True) / grouped.shape[-1] - mean * mean
    naive = (grouped - mean) * torch.rsqrt(var.clamp_min(0) + EPS)
    naive = F.silu(naive.reshape(x.shape) * weight[:, None, None] + bias[:, None, None])
    assert (naive - ref).abs().max() > 0.1


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "no-silu"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_reference_matches_torch(shape, silu, channels_last):
    # Both in fp32 on CPU from the same values; only summation order differs.
    n, c, h, w, g = shape
    x = _input(n, c, h, w, torch.float32)
    if not channels_last:
        x = x.contiguous()
    weight, bias = _affine(c)
    ref = group_norm_silu_reference(x, weight, bias, g, EPS, silu)
    torch.testing.assert_close(
        ref, _torch_group_norm(x, weight, bias, g, EPS, silu), rtol=1e-5, atol=1e-5
    )
    assert ref.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    no_affine = group_norm_silu_reference(x, None, None, g, EPS, silu)
    torch.testing.assert_close(
        no_affine, _torch_group_norm(x, None, None, g, EPS, silu), rtol=1e-5, atol=1e-5
    )


def test_reference_keeps_dtype():
    x = _input(1, 64, 4, 4, torch.bfloat16)
    weight, bias = _affine(64)  # fp32 params with a bf16 input
    ref = group_norm_silu_reference(x, weight, bias, 32, EPS)
    assert ref.dtype == torch.bfloat16
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(
        ref.float(), _torch_group_norm(x, weight, bias, 32, EPS, True), rtol=rtol, atol=atol
    )


def _unsupported_cases():
    cl = torch.channels_last
    good = torch.randn(1, 64, 4, 4).contiguous(memory_format=cl)
    ints = torch.randint(0, 9, (1, 64, 4, 4), dtype=torch.int32).contiguous(memory_format=cl)
    return {
        "nchw": (torch.randn(1, 64, 4, 4), None, None, 32),
        "groups-do-not-divide": (good[:, :48].contiguous(memory_format=cl), None, None, 32),
        "3-d": (torch.randn(1, 64, 16), None, None, 32),
        "int": (ints, None, None, 32),
        "fp64": (good.double(), None, None, 32),
        "empty": (torch.randn(0, 64, 4, 4).contiguous(memory_format=cl), None, None, 32),
        "weight-size": (good, torch.ones(32), None, 32),
        "weight-device": (good, torch.ones(64, device="meta"), None, 32),
        "bias-int": (good, None, torch.ones(64, dtype=torch.int64), 32),
    }


@pytest.mark.parametrize("case", list(_unsupported_cases()))
def test_unsupported_returns_none(case):
    x, weight, bias, g = _unsupported_cases()[case]
    reason = group_norm_silu_unsupported(x, weight, bias, g)
    assert isinstance(reason, str) and reason
    assert group_norm_silu(x, weight, bias, g, EPS) is None


def test_supported_and_autograd():
    x = _input(1, 64, 4, 4, torch.float32)
    weight = torch.nn.Parameter(torch.ones(64))  # requires grad, like a module's parameter
    assert group_norm_silu_unsupported(x, None, None, 32) is None
    # With autograd on, a kernel without backward would silently drop the graph: refuse.
    assert group_norm_silu_unsupported(x, weight, None, 32)
    assert group_norm_silu(x, weight, None, 32, EPS) is None
    with torch.inference_mode():
        assert group_norm_silu_unsupported(x, weight, None, 32) is None
        assert group_norm_silu(x, weight, None, 32, EPS) is not None


def test_declines_while_torch_compile_traces(monkeypatch):
    x = _input(1, 64, 4, 4, torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert group_norm_silu_unsupported(x, None, None, 32) == "torch.compile tracing"
    assert group_norm_silu(x, None, None, 32, EPS) is None


def test_imports_and_falls_back_without_triton():
    repo = pathlib.Path(__file__).resolve().parents[2]
    script = textwrap.dedent(
        """
        import importlib.util, pathlib, sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        repo = pathlib.Path(sys.argv[1])
        spec = importlib.util.spec_from_file_location(
            "fast_vae_decode", repo / "__init__.py", submodule_search_locations=[str(repo)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["fast_vae_decode"] = module
        spec.loader.exec_module(module)
        import torch
        import torch.nn.functional as F
        from fast_vae_decode.kernels import group_norm_silu as k
        assert k.triton is None
        x = torch.randn(1, 64, 4, 4).contiguous(memory_format=torch.channels_last)
        reason = k.group_norm_silu_unsupported(x, None, None, 32)
        assert reason and reason.startswith("no Triton"), reason
        assert k.group_norm_silu(x, None, None, 32, 1e-6) is None
        ref = k.group_norm_silu_reference(x, None, None, 32, 1e-6)
        expected = F.silu(F.group_norm(x, 32, eps=1e-6))
        assert torch.allclose(ref, expected, rtol=1e-5, atol=1e-5)
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(repo)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---- tier 3: GPU, real sizes ----------------------------------------------------------------

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
    with torch.inference_mode():
        _check(x, weight, bias, g, tol=GPU_TOL[dtype])
        _check(x, None, None, g, silu=False, tol=GPU_TOL[dtype])


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
