"""``kernels.rms_norm_silu``: the fused Triton kernel vs its reference, the reference vs the
stock Wan ``RMS_norm`` formula, and the inputs the kernel must refuse.

Tier 1: the kernel runs under ``TRITON_INTERPRET=1`` on small shapes. (Tier 3, the sizes of a
Wan 2.1 480x832 decode on a GPU, is in test_rms_norm_silu_gpu.py.)
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.kernels.rms_norm_silu import (
    rms_norm_silu,
    rms_norm_silu_config,
    rms_norm_silu_reference,
    rms_norm_silu_unsupported,
)
from support.rms_norm_silu_inputs import _channels_last

# (shape, bias kind, silu)
CASES = [
    ((1, 32, 4, 8, 8), "none", True),  # the plain case: power-of-2 C, 256 pixels = exactly
    # one full tile (BLOCK_P=256 at C=32), nothing masked
    ((1, 96, 3, 5, 7), "none", True),  # Wan's C=96: three unmasked 32-channel tiles per pixel
    # (SPLIT 3); 105 pixels over BLOCK_P=32: four tiles, the last one partial
    ((2, 48, 1, 3, 5), "tensor", True),  # N=2 (batch stride); bias tensor (stock bias=True);
    # the smallest split (three 16-channel tiles)
    ((1, 24, 6, 5), "float", False),  # 4-D channels_last as the attention block norm (no SiLU);
    # bias as the python 0. diffusers stores
    ((2, 40, 3, 3), "tensor", True),  # 4-D with N=2 and a bias tensor
    ((1, 3, 2, 2, 2), "none", True),  # tiny odd C (3 of a 4-wide tile), 8 pixels
    ((1, 260, 1, 2, 3), "float-nonzero", True),  # C just above a power of 2 (512-wide tile,
    # mostly masked); a nonzero python-number bias (the kernel's scalar-bias argument)
]


def _params(channels, ndim, bias_kind, gen, stock_shape=True):
    """gamma/bias as the stock module holds them: (C,1,1,1) for 3-D norms, (C,1,1) for 2-D."""
    shape = (channels,) + (1,) * (ndim - 2) if stock_shape else (channels,)
    gamma = 1.0 + 0.5 * torch.randn(shape, generator=gen)
    bias = {
        "none": None,
        "float": 0.0,
        "float-nonzero": 0.25,
        "tensor": 0.3 * torch.randn(shape, generator=gen),
    }[bias_kind]
    return gamma, bias


def _stock(x, gamma, bias, silu):
    """ComfyUI ``RMS_norm.forward`` (+ ``nn.SiLU``), written from its formula."""
    y = F.normalize(x, dim=1) * x.shape[1] ** 0.5 * gamma + (0 if bias is None else bias)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("shape,bias_kind,silu", CASES)
def test_reference_matches_stock_formula_fp32(shape, bias_kind, silu):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    gamma, bias = _params(shape[1], len(shape), bias_kind, gen)
    # fp32 in, same operations in the same order: only the norm's reduction order may differ.
    torch.testing.assert_close(
        rms_norm_silu_reference(x, gamma, bias, silu=silu),
        _stock(x, gamma, bias, silu),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,bias_kind,silu", CASES)
def test_kernel_matches_reference(shape, bias_kind, silu, dtype):
    gen = torch.Generator().manual_seed(1)
    x = _channels_last(torch.randn(shape, generator=gen).to(dtype))
    gamma, bias = _params(shape[1], len(shape), bias_kind, gen)
    assert rms_norm_silu_unsupported(x, gamma, bias) is None
    out = rms_norm_silu(x, gamma, bias, silu=silu)
    ref = rms_norm_silu_reference(x, gamma, bias, silu=silu)
    assert out.dtype == dtype and out.shape == x.shape
    assert out.is_contiguous(
        memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    )
    if dtype == torch.float32:
        # Both fp32; they differ in summation order and in x*(scale/norm) vs x/norm*scale:
        # a few ulp of values of order 1.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        # Both round an fp32 result to bf16 once, so they are at most one bf16 ulp apart (2**-7
        # of the value's binade): fp32 noise can flip a rounding, and the Triton 3.8 interpreter
        # truncates fp32->bf16 where the GPU rounds to nearest. atol for values near 0.
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)


def test_reference_matches_diffusers_module():
    wan = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")
    gen = torch.Generator().manual_seed(4)
    norm = wan.WanRMS_norm(40, images=False, bias=True)
    with torch.no_grad():
        norm.gamma.copy_(1.0 + 0.5 * torch.randn(norm.gamma.shape, generator=gen))
        norm.bias.copy_(0.3 * torch.randn(norm.bias.shape, generator=gen))
        x = torch.randn(1, 40, 2, 3, 5, generator=gen)
        # fp32: the module's own forward in the same operation order as the reference.
        torch.testing.assert_close(
            rms_norm_silu_reference(x, norm.gamma, norm.bias, silu=False),
            norm(x),
            rtol=1e-6,
            atol=1e-6,
        )


def test_flat_params_and_sliced_batch():
    gen = torch.Generator().manual_seed(2)
    base = _channels_last(torch.randn(2, 16, 4, 3, 3, generator=gen))
    # A time slice of a channels-last-3d batch: samples stay dense, the batch stride does not
    # (what a Wan causal cache slice looks like); gamma/bias flat (C,) as diffusers may pass.
    x = base[:, :, 1:3]
    gamma, bias = _params(16, 5, "tensor", gen, stock_shape=False)
    out = rms_norm_silu(x, gamma, bias)
    torch.testing.assert_close(out, rms_norm_silu_reference(x, gamma, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_pixel_uses_eps_clamp(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 96, 1, 2, 3, generator=gen).to(dtype)
    x[0, :, 0, 1, 2] = 0  # norm 0: the 1e-12 clamp must give 0, not NaN
    x = _channels_last(x)
    gamma, bias = _params(96, 5, "tensor", gen)
    out = rms_norm_silu(x, gamma, bias)
    assert torch.isfinite(out).all()
    expected = F.silu(bias.reshape(96).to(dtype).float()).to(dtype)
    # silu(0*gamma + bias): the kernel adds fp32 bias then rounds once; expected rounds bias to
    # dtype first, so one ulp of dtype apart at most.
    torch.testing.assert_close(out[0, :, 0, 1, 2], expected, rtol=2**-7, atol=1e-6)


def test_empty_input():
    x = _channels_last(torch.empty(1, 8, 0, 4, 4))
    out = rms_norm_silu(x, torch.ones(8), None)
    assert out.shape == x.shape


def _x(shape=(1, 8, 2, 3, 3), dtype=torch.float32):
    return _channels_last(torch.randn(shape).to(dtype))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: (torch.randn(1, 8, 2, 3, 3), torch.ones(8), None), id="contiguous-ncthw"
        ),
        pytest.param(
            lambda: (_channels_last(torch.randint(0, 5, (1, 8, 2, 3, 3))), torch.ones(8), None),
            id="int-dtype",
        ),
        pytest.param(lambda: (torch.randn(1, 8, 5), torch.ones(8), None), id="3-d"),
        pytest.param(lambda: (_x(dtype=torch.float64), torch.ones(8), None), id="float64"),
        pytest.param(lambda: (_x(), torch.ones(7), None), id="gamma-numel"),
        pytest.param(lambda: (_x(), torch.ones(8), torch.zeros(4)), id="bias-numel"),
        pytest.param(lambda: (_x(), torch.ones(8, dtype=torch.int32), None), id="gamma-int"),
        pytest.param(lambda: (_x(), torch.ones(8, requires_grad=True), None), id="autograd"),
    ],
)
def test_unsupported_returns_none(make):
    x, gamma, bias = make()
    assert isinstance(rms_norm_silu_unsupported(x, gamma, bias), str)
    assert rms_norm_silu(x, gamma, bias) is None


def test_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = rms_norm_silu_unsupported(_x(), torch.ones(8), None)
    assert reason is not None and "cpu" in reason


def test_config_covers_wan_channels():
    for channels in (3, 96, 192, 384, 1024, 8192):
        block_p, block_c, num_warps, split = rms_norm_silu_config(channels, 2)
        assert block_c * split >= channels and block_c & (block_c - 1) == 0
        # Wan's 3 * 2^k channel counts as three unmasked tiles, the others as one
        assert split == (3 if channels in (96, 192, 384) else 1)
        assert block_p >= 1 and block_p & (block_p - 1) == 0
        assert num_warps in (1, 2, 4, 8, 16)


def test_imports_without_triton():
    """The module must import, refuse and fall back when Triton is absent."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    code = f"""
import importlib.util, sys, torch
sys.modules["triton"] = None  # makes `import triton` raise ImportError
spec = importlib.util.spec_from_file_location(
    "fast_vae_decode", {str(repo / "__init__.py")!r}, submodule_search_locations=[{str(repo)!r}])
pkg = importlib.util.module_from_spec(spec); sys.modules["fast_vae_decode"] = pkg
spec.loader.exec_module(pkg)
from fast_vae_decode.kernels import rms_norm_silu as m
x = torch.randn(1, 8, 2, 3, 3).contiguous(memory_format=torch.channels_last_3d)
assert "Triton" in m.rms_norm_silu_unsupported(x, torch.ones(8), None)
assert m.rms_norm_silu(x, torch.ones(8), None) is None
assert m.rms_norm_silu_reference(x, torch.ones(8), None).shape == x.shape
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# Folded input (addends, in_bias) and a preallocated ``out``. Shapes are (C, T, H, W); the batch
# comes from the out kind.
FOLD_SHAPES = [
    (96, 3, 5, 7),  # Wan's C=96 (three 32-channel tiles); 105 pixels over BLOCK_P=32: four
    # tiles, the last partial, so masked rows meet in_bias
    (32, 2, 3, 4),  # power-of-2 C, 24 pixels: one partial tile
]
# new: out=None; fresh: a preallocated channels-last-3d tensor; time-slice: buf[:, :, 2:] of a
# (1, C, T+2, H, W) cache buffer (the batch stride differs from x's, and must not matter);
# batch2: the same slice of a batch-2 buffer, so out's batch stride is used and differs from x's.
OUT_KINDS = ["new", "fresh", "time-slice", "batch2"]


def _fold_inputs(channels, t, h, w, batch, n_addends, with_in_bias, dtype, gen):
    shape = (batch, channels, t, h, w)
    x = _channels_last(torch.randn(shape, generator=gen).to(dtype))
    addends = tuple(
        _channels_last(torch.randn(shape, generator=gen).to(dtype)) for _ in range(n_addends)
    )
    in_bias = 0.5 * torch.randn(channels, generator=gen).to(dtype) if with_in_bias else None
    gamma, bias = _params(channels, 5, "tensor", gen)
    return x, addends, in_bias, gamma, bias


def _out_for(kind, x, gen):
    """(out, buf): out as the kernel gets it; buf the tensor it is a view of (or None)."""
    if kind == "new":
        return None, None
    if kind == "fresh":
        return torch.empty_like(x, memory_format=torch.channels_last_3d), None
    n, c, t, h, w = x.shape
    if kind == "grid-interior":  # the padded-grid conv's input: strided rows and frames
        buf = _channels_last(torch.randn(n, c, t, h + 2, w + 2, generator=gen).to(x.dtype))
        return buf[:, :, :, 1:-1, 1:-1], buf
    buf = _channels_last(torch.randn(n, c, t + 2, h, w, generator=gen).to(x.dtype))
    return buf[:, :, 2:], buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_kind", OUT_KINDS)
@pytest.mark.parametrize("with_in_bias", [False, True])
@pytest.mark.parametrize("n_addends", [0, 1, 2])
@pytest.mark.parametrize("dims", FOLD_SHAPES)
def test_folded_input_and_out_match_reference(dims, n_addends, with_in_bias, out_kind, dtype):
    gen = torch.Generator().manual_seed(5)
    batch = 2 if out_kind == "batch2" else 1
    x, addends, in_bias, gamma, bias = _fold_inputs(
        *dims, batch, n_addends, with_in_bias, dtype, gen
    )
    out, buf = _out_for(out_kind, x, gen)
    head = None if buf is None else buf[:, :, :2].clone()
    kw = {"addends": addends, "in_bias": in_bias}
    assert rms_norm_silu_unsupported(x, gamma, bias, **kw, out=out) is None
    result = rms_norm_silu(x, gamma, bias, **kw, out=out)
    ref = rms_norm_silu_reference(x, gamma, bias, **kw)
    if out is not None:
        assert result is out
    assert result.dtype == dtype and result.shape == x.shape
    if buf is not None:
        assert torch.equal(buf[:, :, :2], head)  # frames before the slice untouched
    # As in test_kernel_matches_reference: the fp32 sum of the inputs is formed in the same
    # order by both, so they differ only in the norm (fp32: a few ulp; bf16: one rounding of an
    # fp32 result each, so at most one bf16 ulp, 2**-7 of the binade).
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(result, ref, rtol=rtol, atol=1e-5)


def test_reference_folds_before_the_norm():
    gen = torch.Generator().manual_seed(6)
    x, addends, in_bias, gamma, bias = _fold_inputs(8, 2, 3, 3, 1, 2, True, torch.float32, gen)
    s = x + addends[0] + addends[1] + in_bias.reshape(8, 1, 1, 1)
    torch.testing.assert_close(
        rms_norm_silu_reference(x, gamma, bias, addends=addends, in_bias=in_bias),
        rms_norm_silu_reference(s, gamma, bias),
        rtol=0,
        atol=0,
    )
    out = torch.empty_like(x)
    assert rms_norm_silu_reference(x, gamma, bias, addends=addends, out=out) is out
    torch.testing.assert_close(out, rms_norm_silu_reference(x, gamma, bias, addends=addends))


def test_bf16_input_with_fp32_in_bias():
    # A conv bias kept in fp32 next to bf16 activations: in_bias may be any float dtype.
    gen = torch.Generator().manual_seed(7)
    x, addends, _, gamma, bias = _fold_inputs(96, 1, 2, 3, 1, 1, False, torch.bfloat16, gen)
    in_bias = 0.5 * torch.randn(96, generator=gen)
    out = rms_norm_silu(x, gamma, bias, addends=addends, in_bias=in_bias)
    ref = rms_norm_silu_reference(x, gamma, bias, addends=addends, in_bias=in_bias)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)  # one bf16 ulp, as above


def _fold_x():
    return _x((1, 8, 2, 3, 3))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: {"addends": (x.contiguous(),)}, id="addend-strides"),
        pytest.param(lambda x: {"addends": (x.clone(),) * 3}, id="three-addends"),
        pytest.param(lambda x: {"addends": (x.clone().double(),)}, id="addend-dtype"),
        pytest.param(lambda x: {"addends": (x[:, :, :1].clone(),)}, id="addend-shape"),
        pytest.param(lambda x: {"in_bias": torch.zeros(7)}, id="in-bias-numel"),
        pytest.param(lambda x: {"out": x}, id="out-is-x"),
        pytest.param(lambda x: {"out": x.clone().to(torch.bfloat16)}, id="out-dtype"),
        pytest.param(lambda x: {"out": torch.empty(x.shape)}, id="out-not-channels-last"),
        pytest.param(lambda x: {"out": torch.empty(1, 8, 1, 3, 3)}, id="out-shape"),
        pytest.param(lambda x: {"tail": x[:, :, 1:].contiguous()}, id="tail-not-channels-last"),
        pytest.param(lambda x: {"tail": torch.empty(1, 8, 3, 3, 3)}, id="tail-longer-than-x"),
        pytest.param(lambda x: {"tail": _channels_last(torch.empty(1, 8, 1, 3, 4))},
                     id="tail-frame-size"),
        pytest.param(lambda x: {"tail": _channels_last(torch.empty(1, 8, 1, 3, 3)).double()},
                     id="tail-dtype"),
        pytest.param(lambda x: {"tail": x}, id="tail-is-x"),
        pytest.param(lambda x: {"tail": x[0, :, 0]}, id="tail-4d"),
    ],
)
def test_unsupported_fold_returns_none(make):
    x = _fold_x()
    kw = make(x)
    reason = rms_norm_silu_unsupported(x, torch.ones(8), None, **kw)
    assert isinstance(reason, str) and reason
    before = x.clone()
    assert rms_norm_silu(x, torch.ones(8), None, **kw) is None
    assert torch.equal(x, before)


# --- the frame tail: the last frames written again, for a causal conv's next chunk -------------

# (channels, frames, tail frames, h, w, batch)
TAIL_SHAPES = [
    (96, 4, 2, 5, 7, 1),  # Wan 2.1's C=96 at a 0.8-style 4-frame chunk: the tail starts inside
    # the second of three 64-pixel tiles (70 of 140 pixels), so one tile stores partly
    (32, 2, 2, 3, 4, 1),  # ComfyUI 0.33's 2-frame slices: the tail is the whole output
    (24, 3, 1, 3, 3, 2),  # one tail frame, batch 2 (tail's own batch stride), C not a
    # multiple of 16
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_kind", ["new", "time-slice", "grid-interior"])
@pytest.mark.parametrize("dims", TAIL_SHAPES)
def test_tail_holds_the_last_frames_of_the_result(dims, out_kind, dtype):
    """``grid-interior``: the padded-grid route's norm writes the grid's interior (a strided
    out) and the next cache (the tail) in one pass."""
    channels, t, k, h, w, batch = dims
    gen = torch.Generator().manual_seed(11)
    x, addends, in_bias, gamma, bias = _fold_inputs(channels, t, h, w, batch, 1, True, dtype, gen)
    out, _ = _out_for("new" if batch > 1 else out_kind, x, gen)
    tail = _channels_last(torch.full((batch, channels, k, h, w), float("nan")).to(dtype))
    kw = {"addends": addends, "in_bias": in_bias, "out": out, "tail": tail}
    assert rms_norm_silu_unsupported(x, gamma, bias, **kw) is None
    result = rms_norm_silu(x, gamma, bias, **kw)
    # The same bytes as the result's last frames: what a copy of them would hold.
    assert torch.equal(tail, result[:, :, t - k:])
    ref_tail = torch.empty_like(tail)
    rms_norm_silu_reference(x, gamma, bias, addends=addends, in_bias=in_bias, tail=ref_tail)
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(tail, ref_tail, rtol=rtol, atol=1e-5)


def test_a_tail_is_refused_beside_a_bordered_out():
    x = _fold_x()  # (1, 8, 2, 3, 3)
    buf = _channels_last(torch.zeros(1, 8, 2, 5, 5))
    tail = _channels_last(torch.empty(1, 8, 1, 3, 3))
    reason = rms_norm_silu_unsupported(x, torch.ones(8), None, out=buf[:, :, :, 1:-1, 1:-1],
                                       out_border=1, tail=tail)
    assert reason == "a frame tail with a bordered out"


# --- the stacked layout: every frame into each slot of a ``stacked_taps`` conv input it feeds --

# (channels, frames, first, frames out, h, w, tail frames)
STACKED_SHAPES = [
    (96, 4, 2, 4, 5, 7, 2),  # Wan 2.1's C=96 (three column tiles) in a 0.8-style 4-frame chunk
    # behind two cached frames: the first new frame feeds only slot 2, the last only slot 0..2
    # of the outputs that exist
    (48, 2, 2, 2, 3, 4, 2),  # 0.33's two-frame pieces; C=48 takes the split path too
    (20, 3, 1, 2, 3, 3, 1),  # one tile, C not a multiple of 16; frames past the last output
    # frame's slots are dropped
    (96, 1, 0, 3, 2, 3, 0),  # a run at the front of the sequence (the first output's slot 0)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", STACKED_SHAPES)
def test_stacked_writes_each_frame_into_every_slot_it_feeds(dims, dtype):
    channels, t, first, frames_out, h, w, k = dims
    gen = torch.Generator().manual_seed(12)
    x, addends, in_bias, gamma, bias = _fold_inputs(channels, t, h, w, 1, 1, True, dtype, gen)
    stacked = torch.full((frames_out, 3 * channels, h, w), 7.0).to(dtype).contiguous(
        memory_format=torch.channels_last)
    expected = stacked.clone()
    tail = _channels_last(torch.full((1, channels, k, h, w), float("nan")).to(dtype)) if k else None
    kw = {"addends": addends, "in_bias": in_bias, "tail": tail}
    assert rms_norm_silu_unsupported(x, gamma, bias, **kw, stacked=stacked,
                                     stacked_first=first) is None
    assert rms_norm_silu(x, gamma, bias, **kw, stacked=stacked, stacked_first=first) is stacked
    ref_tail = None if tail is None else torch.empty_like(tail)
    rms_norm_silu_reference(x, gamma, bias, addends=addends, in_bias=in_bias, tail=ref_tail,
                            stacked=expected, stacked_first=first)
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    # Slots no frame feeds keep what they held (the caller's cached or zero frames).
    assert torch.equal(stacked == 7, expected == 7)
    torch.testing.assert_close(stacked, expected, rtol=rtol, atol=1e-5)
    if tail is not None:
        torch.testing.assert_close(tail, ref_tail, rtol=rtol, atol=1e-5)


def _stacked_for(channels=8, h=3, w=3):
    return torch.empty(2, channels, h, w).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("x,kw,reason", [
    (_fold_x(), {"stacked": _stacked_for(16)}, "does not hold frames"),  # 3 slots of C=8: 24
    (_fold_x(), {"stacked": _stacked_for(24, w=4)}, "does not hold frames"),
    (_fold_x(), {"stacked": torch.empty(2, 24, 3, 3)}, "not channels-last"),
    (_fold_x(), {"stacked": _stacked_for(24), "stacked_first": -1}, "stacked_first"),
    (_fold_x(), {"stacked": _stacked_for(24), "out": torch.empty_like(_fold_x())},
     "stacked with out"),
    (_x((2, 8, 2, 3, 3)), {"stacked": _stacked_for(24)}, "one 5-D video"),
])
def test_stacked_buffers_of_another_shape_or_layout_are_refused(x, kw, reason):
    got = rms_norm_silu_unsupported(x, torch.ones(8), None, **kw)
    assert got is not None and reason in got
    assert rms_norm_silu_unsupported(x[:1], torch.ones(8), None,
                                     stacked=_stacked_for(24)) is None


# --- the pixel norm (``mean_eps``): LTX VAE's ``PixelNorm``, with its blocks' scale/shift ----

# (shape, with scale/shift, silu): LTX decoder widths are 128..1024; small and odd ones here.
PIXEL_CASES = [
    ((1, 32, 3, 5, 7), False, False),  # the bare PixelNorm (decoder head): no gamma, no bias
    ((1, 48, 2, 3, 5), True, True),  # a timestep-conditioned block: * (1 + scale) + shift, SiLU
    ((2, 24, 1, 4, 3), True, True),  # batch 2
    ((1, 5, 2, 2, 3), False, True),  # odd C, masked lanes
]


def _pixel_norm_stock(x, eps=1e-8):
    """ComfyUI ``PixelNorm.forward`` (dim 1), written from its formula."""
    return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + eps)


@pytest.mark.parametrize("shape,affine,silu", PIXEL_CASES)
def test_pixel_norm_reference_matches_stock_formula(shape, affine, silu):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen)
    scale, shift = (0.2 * torch.randn(shape[1], generator=gen) for _ in range(2))
    view = (1, -1) + (1,) * (len(shape) - 2)
    expected = _pixel_norm_stock(x)
    if affine:
        expected = expected * (1 + scale.reshape(view)) + shift.reshape(view)
    if silu:
        expected = F.silu(expected)
    got = rms_norm_silu_reference(x, 1 + scale if affine else None, shift if affine else None,
                                  eps=1e-8, silu=silu, mean_eps=True)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,affine,silu", PIXEL_CASES)
def test_pixel_norm_kernel_matches_reference(shape, affine, silu, dtype):
    gen = torch.Generator().manual_seed(6)
    x = _channels_last(torch.randn(shape, generator=gen).to(dtype))
    gamma = 1 + 0.2 * torch.randn(shape[1], generator=gen) if affine else None
    bias = 0.2 * torch.randn(shape[1], generator=gen) if affine else None
    in_bias = 0.1 * torch.randn(shape[1], generator=gen)  # a conv bias folded into the norm
    kw = dict(eps=1e-8, silu=silu, mean_eps=True, in_bias=in_bias)
    assert rms_norm_silu_unsupported(x, gamma, bias, in_bias=in_bias) is None
    out = rms_norm_silu(x, gamma, bias, **kw)
    ref = rms_norm_silu_reference(x, gamma, bias, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # one bf16 ulp (see above)
    torch.testing.assert_close(out, ref, rtol=tol, atol=1e-5)


def test_pixel_norm_zero_pixel_is_finite():
    x = torch.randn(1, 16, 1, 2, 2)
    x[0, :, 0, 0, 0] = 0  # mean square 0: eps keeps the root positive
    out = rms_norm_silu(_channels_last(x), None, None, eps=1e-8, silu=False, mean_eps=True)
    assert torch.isfinite(out).all() and (out[0, :, 0, 0, 0] == 0).all()


# --- a padded conv input as ``out``: the interior of a buffer, its border by reflection ------

# (B, C, T, H, W): the smallest frames a reflected border takes (2x2: every pixel feeds two
# border rows and columns), a 3-row frame (row 1 feeds both the top and the bottom row), odd
# C over a partial tile with batch 2, frames spanning several tiles (rows cross frames), and
# C=512 (16-pixel tiles) on 40-pixel rows: tiles holding no border pixel skip those stores.
BORDER_SHAPES = [(1, 8, 2, 2, 2), (1, 16, 1, 3, 5), (2, 5, 2, 4, 3), (1, 32, 3, 6, 7),
                 (1, 512, 1, 5, 40)]


def _padded_target(shape, dtype, front=1):
    """A NaN-filled (B, C, front+T+1, H+2, W+2) channels-last-3d buffer and its interior."""
    b, c, t, h, w = shape
    buf = _channels_last(torch.full((b, c, front + t + 1, h + 2, w + 2), float("nan"), dtype=dtype))
    return buf, buf[:, :, front:front + t, 1:1 + h, 1:1 + w]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", BORDER_SHAPES)
def test_out_border_writes_the_reflected_conv_input(shape, dtype):
    gen = torch.Generator().manual_seed(8)
    x = _channels_last(torch.randn(shape, generator=gen).to(dtype))
    c = shape[1]
    gamma, bias = 1.0 + 0.3 * torch.randn(c, generator=gen), 0.2 * torch.randn(c, generator=gen)
    buf, inner = _padded_target(shape, dtype)
    kw = dict(eps=1e-8, mean_eps=True, out=inner, out_border=1)
    assert rms_norm_silu_unsupported(x, gamma, bias, out=inner, out_border=1) is None
    assert rms_norm_silu(x, gamma, bias, **kw) is inner
    ref = rms_norm_silu_reference(x, gamma, bias, eps=1e-8, mean_eps=True)
    b, _, t, h, w = shape
    want = torch.nn.functional.pad(ref.float().reshape(b, c * t, h, w), (1, 1, 1, 1), mode="reflect")
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(buf[:, :, 1:1 + t].float(), want.reshape(b, c, t, h + 2, w + 2),
                               rtol=rtol, atol=1e-5)
    assert buf[:, :, 0].isnan().all() and buf[:, :, -1].isnan().all()  # other frames untouched
    # The reference writes the same border (it is what the conv input falls back to).
    buf2, inner2 = _padded_target(shape, dtype)
    rms_norm_silu_reference(x, gamma, bias, **dict(kw, out=inner2))
    torch.testing.assert_close(buf2[:, :, 1:1 + t].float(), buf[:, :, 1:1 + t].float(), rtol=rtol, atol=1e-5)


def test_strided_out_without_border_leaves_the_border_alone():
    gen = torch.Generator().manual_seed(9)
    x = _channels_last(torch.randn((1, 16, 2, 3, 4), generator=gen))
    buf, inner = _padded_target(x.shape, torch.float32)
    assert rms_norm_silu(x, None, None, mean_eps=True, out=inner) is inner
    torch.testing.assert_close(inner, rms_norm_silu_reference(x, None, None, mean_eps=True))
    assert buf[:, :, 1:3, 0].isnan().all() and buf[:, :, 1:3, :, -1].isnan().all()


@pytest.mark.parametrize(
    "make,expected",
    [
        pytest.param(lambda x, inner: {"out_border": 1}, "needs out", id="border-without-out"),
        pytest.param(lambda x, inner: {"out": inner, "out_border": 2}, "out_border 2", id="border-2"),
        # a strided view whose channels are not contiguous (NCDHW, one row cut off)
        pytest.param(lambda x, inner: {"out": torch.empty(1, 8, 2, 4, 3)[:, :, :, :3]},
                     "channels-last", id="strided-channels"),
    ],
)
def test_unsupported_padded_out_returns_none(make, expected):
    x = _fold_x()
    _, inner = _padded_target(x.shape, torch.float32)
    reason = rms_norm_silu_unsupported(x, torch.ones(8), None, **make(x, inner))
    assert reason is not None and expected in reason


def test_a_reflected_border_needs_frames_two_pixels_wide():
    x = _channels_last(torch.randn(1, 8, 2, 1, 3))  # one row: no row 1 to reflect
    _, inner = _padded_target(x.shape, torch.float32)
    reason = rms_norm_silu_unsupported(x, None, None, out=inner, out_border=1)
    assert reason is not None and "too small" in reason
    assert rms_norm_silu_unsupported(x, None, None, out=inner) is None  # no border: fine
