"""The padded-grid conv's layout math and twins on the CPU (tier 1; the DSL kernel itself runs
in test_padded_grid_conv_gpu.py).

``padded_grid_gemm_reference`` is the kernel's GEMM (rows of the padded grid, the affine view
of the input, the packed weight's reduction order, junk rows dropped) in plain torch: if it
equals the stock conv, the layouts the kernel's TMA descriptors are built from are right.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.kernels import padded_grid_conv as pgc

# (C, Cout, KT, frames out, H, W), each for a reason:
SHAPES = [
    (16, 8, 3, 2, 5, 7),   # odd sizes: the padding columns and rows fall mid-tile
    (12, 20, 3, 1, 4, 3),  # one output frame; channels not a multiple of 16
    (8, 8, 1, 3, 6, 6),    # a 2-D conv (KT = 1) over a batch of frames
    (6, 4, 3, 3, 1, 1),    # a single-pixel frame: every window but one is padding
]


def _inputs(c, cout, kt, t_out, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, c, t_out + kt - 1, h, w, generator=g)
    weight = torch.randn(cout, c, kt, 3, 3, generator=g) / (c * 9 * kt) ** 0.5
    bias = torch.randn(cout, generator=g)
    return x, weight, bias


def _padded(x):
    padded, interior = pgc.empty_padded(tuple(x.shape), x.dtype, x.device)
    interior.copy_(x)
    return padded


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_gemm_over_the_padded_grid_is_the_conv(shape):
    x, weight, bias = _inputs(*shape)
    expected = F.conv3d(x, weight, bias, padding=(0, 1, 1))
    padded = _padded(x)
    packed = pgc.pack_padded_grid_weight(weight)
    gemm = pgc.padded_grid_gemm_reference(padded, packed, bias)
    twin = pgc.padded_grid_conv_reference(padded, weight, bias)
    assert gemm.shape == expected.shape == twin.shape
    assert gemm.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(gemm, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twin, expected, rtol=1e-5, atol=1e-5)


def test_residual_is_added_to_the_rounded_conv_output():
    """The epilogue's residual add (a residual block's second conv, identity shortcut): the
    conv + bias rounded to bf16, then + residual rounded again, as stock's conv and its
    ``x + h``; both twins agree with that."""
    x, weight, bias = _inputs(16, 16, 3, 2, 5, 7)
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    residual = torch.randn(1, 16, 2, 5, 7, generator=torch.Generator().manual_seed(3))
    residual = residual.to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    conv = F.conv3d(x.float(), weight.float(), bias, padding=(0, 1, 1)).to(torch.bfloat16)
    expected = (conv.float() + residual.float()).to(torch.bfloat16)
    padded = _padded(x)
    packed = pgc.pack_padded_grid_weight(weight)
    for got in (pgc.padded_grid_gemm_reference(padded, packed, bias, residual),
                pgc.padded_grid_conv_reference(padded, weight, bias, residual)):
        assert got.is_contiguous(memory_format=torch.channels_last_3d)
        # the fp32 sums' order differs from F.conv3d's: one bf16 step at most
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-7)


def test_gemm_ignores_what_lies_in_the_slack_rows():
    """Only dropped windows read the storage past the last frame."""
    x, weight, bias = _inputs(16, 8, 3, 2, 5, 7)
    padded = _padded(x)
    packed = pgc.pack_padded_grid_weight(weight)
    clean = pgc.padded_grid_gemm_reference(padded, packed, bias)
    storage = padded.as_strided((padded.untyped_storage().nbytes() // 4,), (1,), 0)
    storage[padded.numel():] = float("nan")
    torch.testing.assert_close(pgc.padded_grid_gemm_reference(padded, packed, bias), clean)


def test_empty_padded_zeroes_the_border_and_leaves_room_for_the_slack():
    padded, interior = pgc.empty_padded((1, 3, 2, 4, 5), torch.float32, torch.device("cpu"))
    assert padded.shape == (1, 3, 2, 6, 7) and interior.shape == (1, 3, 2, 4, 5)
    assert padded.is_contiguous(memory_format=torch.channels_last_3d)
    assert interior.data_ptr() == padded[:, :, :, 1:, 1:].data_ptr()
    border = torch.ones_like(padded, dtype=torch.bool)
    border[:, :, :, 1:-1, 1:-1] = False
    assert (padded[border] == 0).all()
    slack = padded.untyped_storage().nbytes() // 4 - padded.numel()
    assert slack == pgc.slack_rows(5) * 3


def test_packed_weight_is_the_reduction_order_channel_fastest():
    weight = torch.arange(2 * 3 * 3 * 3 * 3, dtype=torch.float32).view(2, 3, 3, 3, 3)
    packed = pgc.pack_padded_grid_weight(weight)
    assert packed.shape == (2, 3, 3, 3, 3) and packed.is_contiguous()
    # packed[n, dt, dy, dx, c] == weight[n, c, dt, dy, dx]
    assert packed[1, 2, 0, 1, 2] == weight[1, 2, 2, 0, 1]
    assert pgc.pack_padded_grid_weight(weight[:, :, 0]).shape == (2, 1, 3, 3, 3)


def test_declines_off_the_gpu_without_importing_the_dsl():
    """A CPU tensor is declined before the (slow, optional) DSL import is tried."""
    x, weight, _ = _inputs(96, 96, 3, 1, 4, 4)
    padded = _padded(x.to(torch.bfloat16))
    packed = pgc.pack_padded_grid_weight(weight.to(torch.bfloat16))
    assert pgc.padded_grid_conv_unsupported(padded, packed) == "not a CUDA tensor"
    assert pgc.padded_grid_conv(padded, packed) is None
    assert pgc._KERNEL_CLASS is None and pgc._DSL_ERROR is None  # never imported


def _every_tiling():
    yield from pgc.TILINGS.items()
    yield from ((key, t) for key, tilings in pgc.SWEEP_TILINGS.items() for t in tilings)


def test_tilings_divide_their_channels():
    for (cin, cout, kt), t in _every_tiling():
        assert cin % t.block_k == 0 and cout % t.block_n == 0 and t.block_k % 16 == 0
        assert t.block_n % 8 == 0 and t.block_n <= 256 and kt in (1, 3)
        assert pgc.tiling_reason(t, cin, cout) is None
    assert set(pgc.SWEEP_TILINGS) <= set(pgc.TILINGS)  # candidates for measured shapes only


def _cta_bytes(t: pgc.Tiling) -> int:
    """What one resident CTA of ``t`` holds of its SM's shared memory."""
    plan = pgc.ring_plan(t)
    return (plan.stages * (t.block_m + t.block_n) * t.block_k * 2 + pgc.BARRIER_BYTES
            + pgc.STATIC_SMEM_BYTES + pgc.CTA_RESERVED_BYTES)


def test_every_tiling_holds_its_ctas_in_one_sms_shared_memory():
    """Each tiling's ring, barriers, static shared memory and the hardware's per-CTA share fit
    ``ctas_per_sm`` times in an SM (a 2-per-SM tiling sized for one would run one CTA at a
    time, its epilogue exposed again), and one CTA within the 227 KB a CTA may take."""
    for _, t in _every_tiling():
        plan = pgc.ring_plan(t)
        assert plan is not None and plan.stages >= 2
        assert t.ctas_per_sm * _cta_bytes(t) <= pgc.SM_SMEM_BYTES
        assert _cta_bytes(t) - pgc.CTA_RESERVED_BYTES <= pgc.SMEM_BYTES
        assert t.block_m * plan.staged_row <= plan.stages * t.block_m * t.block_k


def test_two_ctas_per_sm_halve_the_ring_the_measured_tilings_keep_theirs():
    """The measured tilings' rings are as deep as before ``ctas_per_sm`` (one CTA: 227 KB less
    the barriers' KB); the same tile at two per SM gets half the SM's memory."""
    depth = {(96, 96, 3): 3, (192, 192, 3): 4, (192, 384, 3): 5, (384, 384, 3): 5,
             (128, 128, 1): 4, (256, 128, 1): 4, (256, 256, 1): 4, (512, 256, 1): 4,
             (512, 512, 1): 4}
    assert {key: pgc.ring_plan(t).stages for key, t in pgc.TILINGS.items()} == depth
    one, two = pgc.Tiling(128, 96, 32, 2), pgc.Tiling(128, 96, 32, 2, 2)
    assert (pgc.ring_plan(one).stages, pgc.ring_plan(two).stages) == (8, 7)
    assert str(two) == "128x96x32/wg2/2per-SM" and str(one) == "128x96x32/wg2"


def test_sweep_tiling_is_a_candidate_or_none_for_the_measured_tiling():
    """A route's ``padded_grid_candidate`` setting: -1 (the default) and an index past a
    shape's candidates, or a shape without any, leave the measured tiling (None)."""
    first, second = pgc.SWEEP_TILINGS[(96, 96, 3)]
    assert pgc.sweep_tiling(96, 96, 3, -1) is None
    assert (pgc.sweep_tiling(96, 96, 3, 0), pgc.sweep_tiling(96, 96, 3, 1)) == (first, second)
    assert pgc.sweep_tiling(384, 384, 3, 1) is None
    assert pgc.sweep_tiling(64, 64, 3, 0) is None


def test_tiling_reason_names_what_does_not_fit():
    assert "divide" in pgc.tiling_reason(pgc.Tiling(128, 128, 64, 2), 96, 96)
    assert "warpgroup" in pgc.tiling_reason(pgc.Tiling(64, 96, 32, 2), 96, 96)
    # two 256x192x64 CTAs: not even two stages of 57 KB in half an SM
    assert "shared memory" in pgc.tiling_reason(pgc.Tiling(256, 192, 64, 2, 2), 192, 192)
    # seven stages of 32-wide k-tiles fit, but their 112 KB A ring cannot stage a 128 KB tile
    assert "shared memory" in pgc.tiling_reason(pgc.Tiling(256, 256, 32, 2), 256, 256)


def test_declines_a_tiling_that_cannot_run_naming_it():
    """A caller's tiling (the benchmark's sweep) is checked with the tensors, before the
    device, so its reason shows on the CPU too."""
    x, weight, _ = _inputs(96, 96, 3, 2, 4, 4)
    padded = _padded(x.to(torch.bfloat16))
    packed = pgc.pack_padded_grid_weight(weight.to(torch.bfloat16))
    bad = pgc.Tiling(128, 128, 64, 2)
    assert "does not divide" in pgc.padded_grid_conv_unsupported(padded, packed, tiling=bad)
    assert pgc.padded_grid_conv(padded, packed, tiling=bad) is None
    good = pgc.SWEEP_TILINGS[(96, 96, 3)][0]
    assert pgc.padded_grid_conv_unsupported(padded, packed, tiling=good) == "not a CUDA tensor"


def test_declines_what_the_kernel_cannot_read_naming_why():
    """Checked on the tensors before the device: each reason shows on the CPU too."""
    x, weight, _ = _inputs(96, 96, 3, 2, 4, 4)
    packed = pgc.pack_padded_grid_weight(weight.to(torch.bfloat16))
    padded = _padded(x.to(torch.bfloat16))
    no_slack = padded.clone(memory_format=torch.channels_last_3d)  # its storage ends with it
    assert "slack" in pgc.padded_grid_conv_unsupported(no_slack, packed)
    assert pgc.padded_grid_conv_unsupported(padded.float(), packed.float()) == "not bf16"
    narrow = pgc.pack_padded_grid_weight(weight[:64].to(torch.bfloat16))
    assert "no measured tiling" in pgc.padded_grid_conv_unsupported(padded, narrow)
    fewer = _padded(x[:, :48].to(torch.bfloat16))
    assert pgc.padded_grid_conv_unsupported(fewer, packed) == "weight takes 96 channels, input has 48"
    # a residual must be the output's own shape, channels-last-3d, in bf16
    cl3d = torch.channels_last_3d
    for bad in (torch.zeros(1, 96, 3, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=cl3d),
                torch.zeros(1, 96, 2, 4, 4).contiguous(memory_format=cl3d),
                torch.zeros(1, 96, 2, 4, 4, dtype=torch.bfloat16)):
        assert "residual" in pgc.padded_grid_conv_unsupported(padded, packed, None, bad)


def test_declines_sizes_past_its_32_bit_offsets():
    """The kernel indexes with 32-bit offsets: an input (with its slack rows) or an output of
    2^31 or more elements is declined, not read or written past 2^31. Meta tensors: the
    checks need the sizes, not the memory."""
    meta, bf16 = torch.device("meta"), torch.bfloat16
    big, _ = pgc.empty_padded((1, 96, 50, 1500, 2000), bf16, meta)  # 14.4e9 input elements
    packed = torch.empty(96, 3, 3, 3, 96, dtype=bf16, device=meta)
    assert pgc.padded_grid_conv_unsupported(big, packed) == "2^31 or more input elements"
    # 192 -> 384 channels: 2.10e9 input elements (under), 3.25e9 output elements (over)
    wide, _ = pgc.empty_padded((1, 192, 9, 1100, 1100), bf16, meta)
    assert wide.numel() < 2**31
    widen = torch.empty(384, 3, 3, 3, 192, dtype=bf16, device=meta)
    assert pgc.padded_grid_conv_unsupported(wide, widen) == "2^31 or more output elements"


def test_background_preparation_only_for_a_hopper_device():
    assert pgc.prepare_in_background(torch.device("cpu")) is False
    assert pgc._KERNEL_CLASS is None and pgc._DSL_ERROR is None


class _FakeDSL:
    """What ``_compiled`` needs of the DSL, recording each compile's keywords; a TVM FFI
    compile returns a keyword wrapper around a positional function, as the DSL's does."""

    BFloat16 = Float32 = "type"

    def __init__(self):
        self.compiles = []

    @staticmethod
    def Int32(v):
        return v

    def compile(self, kernel, *args, **kwargs):
        self.compiles.append(kwargs)
        positional = ("positional", len(self.compiles))
        if kwargs.get("options") == "--enable-tvm-ffi":
            return type("Wrapper", (), {"__tvm_ffi_object__": lambda self: positional})()
        return ("executor", len(self.compiles))


def test_a_tvm_ffi_compile_is_a_kernel_of_its_own(monkeypatch):
    """``ffi`` compiles the same kernel with the DSL's TVM FFI option, kept apart from the
    DSL-call compile, and keeps the positional function under the DSL's keyword wrapper (the
    one whose calls do no Python work per argument). No GPU: the DSL is stood in for."""
    dsl = _FakeDSL()
    monkeypatch.setattr(pgc, "cute", dsl)
    monkeypatch.setattr(pgc, "cutlass", dsl)
    monkeypatch.setattr(pgc, "_KERNEL_CLASS", lambda *a: "kernel")
    monkeypatch.setattr(pgc, "_ptr", lambda dtype, address: address)
    monkeypatch.setattr(pgc, "_COMPILED", {})
    plain = pgc._compiled(96, 96, 3, False, False, "stream")
    ffi = pgc._compiled(96, 96, 3, False, False, "stream", ffi=True)
    assert plain == ("executor", 1) and ffi == ("positional", 2)
    assert dsl.compiles == [{}, {"options": "--enable-tvm-ffi"}]
    assert pgc._compiled(96, 96, 3, False, False, "stream", ffi=True) is ffi  # kept
    assert len(dsl.compiles) == 2


def test_each_tiling_is_a_kernel_of_its_own(monkeypatch):
    """A sweep tiling compiles its own kernel, built at that tiling, kept apart from the
    shape's default one; no tiling is the shape's ``TILINGS`` entry. No GPU: the DSL is
    stood in for."""
    dsl, built = _FakeDSL(), []
    monkeypatch.setattr(pgc, "cute", dsl)
    monkeypatch.setattr(pgc, "cutlass", dsl)
    monkeypatch.setattr(pgc, "_KERNEL_CLASS", lambda *a: built.append(a[3]) or "kernel")
    monkeypatch.setattr(pgc, "_ptr", lambda dtype, address: address)
    monkeypatch.setattr(pgc, "_COMPILED", {})
    other = pgc.SWEEP_TILINGS[(96, 96, 3)][0]
    default = pgc._compiled(96, 96, 3, True, False, "stream")
    swept = pgc._compiled(96, 96, 3, True, False, "stream", tiling=other)
    assert default != swept and built == [pgc.TILINGS[(96, 96, 3)], other]
    assert pgc._compiled(96, 96, 3, True, False, "stream", tiling=pgc.TILINGS[(96, 96, 3)]) \
        is default
    assert len(built) == 2


def test_tvm_ffi_reason_says_why_without_the_package(monkeypatch):
    """Without ``apache-tvm-ffi`` (CI's case) the reason names it; ``padded_grid_conv`` takes
    its ``ffi`` branch only where this is None."""
    import sys

    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # its import then raises
    monkeypatch.setattr(pgc, "_FFI_CHECKED", False)
    monkeypatch.setattr(pgc, "_FFI_ERROR", None)
    assert pgc.tvm_ffi_reason().startswith("no TVM FFI (ModuleNotFoundError")


def test_a_failed_tvm_ffi_compile_leaves_the_dsl_call(monkeypatch):
    """An optional path fails closed: where the TVM FFI compile raises, ``_ffi_compiled`` gives
    None (the conv takes the DSL's own call), and the reason is kept, so later convs do not
    compile again."""
    dsl = _FakeDSL()

    def compile_or_raise(kernel, *args, **kwargs):
        if kwargs:
            raise RuntimeError("no TVM FFI lowering")
        return _FakeDSL.compile(dsl, kernel, *args, **kwargs)

    monkeypatch.setattr(dsl, "compile", compile_or_raise)
    monkeypatch.setattr(pgc, "cute", dsl)
    monkeypatch.setattr(pgc, "cutlass", dsl)
    monkeypatch.setattr(pgc, "_KERNEL_CLASS", lambda *a: "kernel")
    monkeypatch.setattr(pgc, "_ptr", lambda dtype, address: address)
    monkeypatch.setattr(pgc, "_cuda", type("Driver", (), {"CUstream": staticmethod(str)}))
    monkeypatch.setattr(pgc, "_COMPILED", {})
    monkeypatch.setattr(pgc, "_STREAMS", {})
    monkeypatch.setattr(pgc, "_FFI_CHECKED", True)
    monkeypatch.setattr(pgc, "_FFI_ERROR", None)
    assert pgc._ffi_compiled(96, 96, 3, False, False, 7) is None
    assert pgc.tvm_ffi_reason().startswith("TVM FFI compile failed (RuntimeError")
    assert pgc._ffi_compiled(96, 96, 3, False, False, 7) is None
    assert pgc._compiled(96, 96, 3, False, False, "7") == ("executor", 1)


def test_a_refused_tvm_ffi_call_runs_the_dsl_call(monkeypatch):
    """The TVM FFI function refusing its arguments (the form of the stream handle is what a GPU
    has not yet confirmed) costs that conv nothing: the same call goes through the DSL's
    executor, and the reason is kept so later convs go there at once. No GPU: the DSL, the
    checks and the stream are stood in for."""
    import contextlib
    import types

    calls = []

    def refusing(*args):
        calls.append(("ffi", args))
        raise TypeError("Mismatched type on argument #8")

    def executor(*args):
        calls.append(("dsl", args))

    dsl = _FakeDSL()
    monkeypatch.setattr(pgc, "cute", dsl)
    monkeypatch.setattr(pgc, "cutlass", dsl)
    monkeypatch.setattr(pgc, "_ptr", lambda dtype, address: address)
    monkeypatch.setattr(pgc, "_cuda", types.SimpleNamespace(CUstream=str))
    monkeypatch.setattr(pgc, "_STREAMS", {})
    monkeypatch.setattr(pgc, "_compiled",
                        lambda *a, ffi=False, tiling=None: refusing if ffi else executor)
    monkeypatch.setattr(pgc, "padded_grid_conv_unsupported", lambda *a: None)
    monkeypatch.setattr(pgc, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(pgc, "_FFI_CHECKED", True)
    monkeypatch.setattr(pgc, "_FFI_ERROR", None)
    padded, _ = pgc.empty_padded((1, 96, 3, 2, 2), torch.bfloat16, torch.device("cpu"),
                                  bordered=False)
    packed = torch.zeros(96, 3, 3, 3, 96, dtype=torch.bfloat16)
    out = pgc.padded_grid_conv(padded, packed, ffi=True)
    assert out.shape == (1, 96, 1, 2, 2)
    assert [kind for kind, _ in calls] == ["ffi", "dsl"]
    assert calls[1][1][3] == out.data_ptr() and calls[1][1][-1] == "7"
    assert pgc.tvm_ffi_reason().startswith("TVM FFI call failed (TypeError")
    calls.clear()
    pgc.padded_grid_conv(padded, packed, ffi=True)
    assert [kind for kind, _ in calls] == ["dsl"]
