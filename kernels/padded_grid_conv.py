"""Stride-1 3x3 / 3x3x3 convolution on Hopper as a WGMMA GEMM in CUTLASS's Python DSL (CuTe
DSL), fed by one TMA view of a zero-padded input: no im2col buffer, no per-tap outputs.

The padded grid: the input is stored with one zero pixel around each frame, (T_in, H + 2,
W + 2, C) with C innermost (a channels-last-3d (1, C, T_in, H + 2, W + 2) tensor), so every
window lies inside it. The GEMM's rows are that grid's pixels q = t * (H+2)(W+2) + y * (W+2) + x
(the window's top-left corner), its reduction runs over (channel, dx, dy, dt), and the input
element it needs is at pixel q + dt * (H+2)(W+2) + dy * (W+2) + dx: affine in (q, c, dx, dy, dt),
so one tensor-memory-accelerator descriptor of five dimensions loads every tap's tile. Rows
whose window starts in the padding (2 / (W+2) + 2 / (H+2) of the work) are computed and not
stored: the epilogue writes the others to a dense channels-last-3d (1, N, T_out, H, W) output.
The input holds KT - 1 frames more than the output (a causal conv's cached frames in front)
and ``SLACK_ROWS(W)`` pixel rows of storage after its last frame, which the dropped windows of
the last frame's bottom rows read.

Measured (H100, docs/benchmark/s47): CUTLASS's own Hopper GEMM example fed this view ran Wan
2.1's 192- and 384-channel 3x3x3 convs 1.19-1.26x faster than cuDNN's conv3d and its
96-channel conv 1.08x faster than the three 2-D tap convs the fast path ran there, while
writing one output instead of three; the 2-D KL convs stayed at 0.90-0.99x cuDNN's speed.
``TILINGS`` holds the shapes this kernel takes and their tiles, as data; others decline.

Optional: it needs ``nvidia-cutlass-dsl`` (no torch dependency, so installing it never replaces
ComfyUI's torch) and an sm_90 GPU. Without them every call declines and the caller keeps its
cuDNN route. The DSL is imported only when a Hopper device first asks for it. Its plain-torch twin and test oracle is ``padded_grid_conv_reference``.

One compile per (channels in, out, temporal taps, tiling), shapes at run time: 0.2-0.5 s each
here (sm_90a, no GPU), cached by the DSL on disk like Triton's.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import on_device

# The DSL is imported on first use, not with the pack: importing it takes ~2.3 s (measured
# here, python 3.12), which ComfyUI's start-up must not pay. Its modules then become these
# globals, which the kernel's string annotations resolve against.
cutlass = cute = pipeline = cutlass_utils = sm90 = _cuda = None
_DSL_ERROR: str | None = None
_DSL_LOCK = threading.Lock()
_KERNEL_CLASS = None


def _load_dsl() -> str | None:
    """Import the DSL once (thread-safe); None when it is there, else why not."""
    global cutlass, cute, pipeline, cutlass_utils, sm90, _cuda, _DSL_ERROR, _KERNEL_CLASS
    if _KERNEL_CLASS is not None:  # every conv call asks: no lock once it is loaded
        return None
    with _DSL_LOCK:
        if _KERNEL_CLASS is None and _DSL_ERROR is None:
            try:
                import cuda.bindings.driver as cuda_driver
                import cutlass as cutlass_mod
                import cutlass.cute as cute_mod
                import cutlass.pipeline as pipeline_mod
                import cutlass.utils as utils_mod
                import cutlass.utils.hopper_helpers as sm90_mod
            except Exception as exc:  # ImportError, or a broken install raising anything
                _DSL_ERROR = f"no CUTLASS DSL ({type(exc).__name__}: {exc})".splitlines()[0][:160]
            else:
                cutlass, cute, pipeline, cutlass_utils, sm90, _cuda = (
                    cutlass_mod, cute_mod, pipeline_mod, utils_mod, sm90_mod, cuda_driver)
                _KERNEL_CLASS = _define_kernel()
        return _DSL_ERROR


SMEM_BYTES = 227 * 1024  # sm_90's dynamic shared memory per CTA
# 32-bit offsets inside the kernel: the padded input and the output stay under 2^31 elements.
MAX_ELEMENTS = 2**31 - 1


def slack_rows(w: int) -> int:
    """Pixel rows of storage the input needs after its last frame (windows starting in that
    frame's two bottom padding rows reach 2 * (W + 2) + 2 pixels past it)."""
    return 3 * (w + 2)


@dataclass(frozen=True)
class Tiling:
    """One CTA's tile: ``block_m`` grid rows x ``block_n`` outputs x ``block_k`` reduction,
    ``warpgroups`` MMA warpgroups splitting its rows, ``ctas_per_sm`` CTAs an SM runs at once
    (each one's ring then takes its share of the SM's shared memory: ``ring_plan``)."""

    block_m: int
    block_n: int
    block_k: int
    warpgroups: int
    ctas_per_sm: int = 1

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.block_k}/wg{self.warpgroups}"
        return text if self.ctas_per_sm == 1 else f"{text}/{self.ctas_per_sm}per-SM"


SM_SMEM_BYTES = 228 * 1024  # sm_90's shared memory per SM; a CTA may take SMEM_BYTES of it
CTA_RESERVED_BYTES = 1024  # the share of it the hardware keeps per resident CTA
# Each compiled kernel's static shared memory (its sm_90a cubins, s52), and the ring's barriers
# with the alignment the A ring starts at: both beside the ring in every CTA.
STATIC_SMEM_BYTES = 1024
BARRIER_BYTES = 1024


@dataclass(frozen=True)
class RingPlan:
    """How a tiling uses shared memory: ``stages`` k-tiles of A and B in flight, and the output
    tile staged for the epilogue in the A ring (free once the last WGMMA has read it),
    ``staged_row`` elements per row."""

    stages: int
    staged_row: int


def ring_plan(tiling: Tiling) -> RingPlan | None:
    """The shared-memory plan of ``tiling``, or None where it cannot have one (fewer than two
    stages fit its CTA's share, or the staged output tile does not fit the A ring)."""
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    share = min(SMEM_BYTES, SM_SMEM_BYTES // tiling.ctas_per_sm - CTA_RESERVED_BYTES)
    stages = min(8, (share - STATIC_SMEM_BYTES - BARRIER_BYTES) // ((bm + bn) * bk * 2))
    if stages < 2:
        return None
    ring_a = stages * bm * bk  # elements
    # Rows padded by 16 bytes against bank conflicts where that fits (256x192 fills it exactly).
    staged_row = bn + (8 if bm * (bn + 8) <= ring_a else 0)
    if bm * staged_row > ring_a:
        return None
    return RingPlan(stages, staged_row)


# (channels in, out, temporal taps) -> tiling: the shapes the kernel takes, each the fastest
# tiling of the one-CTA-per-tile kernel CUTLASS's example measured there (H100, s47 lab,
# sweeps 1-3; clusters of two, which the example also tried, are not implemented here).
TILINGS: dict[tuple[int, int, int], Tiling] = {
    (96, 96, 3): Tiling(256, 96, 96, 2),     # Wan 2.1 full resolution
    (192, 192, 3): Tiling(256, 192, 64, 2),  # Wan 2.1 240x416
    # Wan 2.1 120x208, the stage's first conv: not in the lab; the 384-channel conv's tile
    (192, 384, 3): Tiling(128, 192, 64, 2),
    (384, 384, 3): Tiling(128, 192, 64, 2),  # Wan 2.1 120x208
    # 2-D 3x3 convs (one temporal tap, a batch's images as the grid's frames): the KL decoders'
    # resnet convs, each the faster of two tilings against cuDNN's conv2d + bias, bias in the
    # epilogue (H100, s49, docs/benchmark/s49/h100/kl.log; SDXL 1024² shapes). Their decode
    # route is off: there cuDNN's bias-free convs are faster (``kl.settings``).
    (128, 128, 1): Tiling(256, 128, 64, 2),  # 1024²: 1.61x (SD1.5 768x512 b4: 1.60x)
    (256, 128, 1): Tiling(256, 128, 64, 2),  # 1024², the stage's first conv: 1.31x
    (256, 256, 1): Tiling(128, 256, 64, 2),  # 512²: 1.27x (SD1.5 b4 384x256: 1.27x)
    (512, 256, 1): Tiling(128, 256, 64, 2),  # 512², the stage's first conv: 1.16x
    (512, 512, 1): Tiling(128, 256, 64, 2),  # 256²: 1.17x; 128²: 0.85x (kl.settings's floor)
}

# Candidates the per-conv benchmark's sweep times beside each shape's tiling (``bench convs
# --sweep``; not measured yet). Every tiling above fills its SM with one CTA's ring, so each
# tile's ring fill and epilogue (staging, the stores, the residual's loads) leave the tensor
# cores idle; with two CTAs per SM one CTA's epilogue runs beside the other's main loop, for
# half the ring each. Tiles whose accumulators stay at 64 fp32 registers a thread or fewer, so
# that two CTAs' 512 threads fit the register file (compiled here, sm_90a: 82-119 registers a
# thread, no local memory; docs/benchmark/s52/regs.log).
SWEEP_TILINGS: dict[tuple[int, int, int], tuple[Tiling, ...]] = {
    (96, 96, 3): (Tiling(128, 96, 96, 2, 2), Tiling(128, 96, 32, 2, 2)),
    (192, 192, 3): (Tiling(128, 96, 64, 2, 2),),
    (192, 384, 3): (Tiling(128, 128, 64, 2, 2),),
    (384, 384, 3): (Tiling(128, 128, 64, 2, 2),),
    (128, 128, 1): (Tiling(128, 128, 64, 2, 2),),
    (256, 128, 1): (Tiling(128, 128, 64, 2, 2),),
    (256, 256, 1): (Tiling(128, 128, 64, 2, 2),),
    (512, 256, 1): (Tiling(128, 128, 64, 2, 2),),
    (512, 512, 1): (Tiling(128, 128, 64, 2, 2),),
}


def sweep_tiling(cin: int, cout: int, kt: int, index: int) -> Tiling | None:
    """``SWEEP_TILINGS``' candidate ``index`` for a shape, for a caller's ``tiling=``; None (the
    shape's own ``TILINGS`` entry) where ``index`` is negative or the shape has no such one."""
    if index < 0:
        return None
    candidates = SWEEP_TILINGS.get((cin, cout, kt), ())
    return candidates[index] if index < len(candidates) else None


# Per CUDA device index: whether it is an sm_90. Every routed conv asks twice (route, kernel),
# and torch's capability query resolves the device and reads its properties each time: host
# time where a Wan decode on ComfyUI 0.33 already leaves the GPU waiting (s50 profile).
_HOPPER: dict[int, bool] = {}


def _is_hopper(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    hopper = _HOPPER.get(index)
    if hopper is None:
        hopper = _HOPPER[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hopper


def dsl_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the kernel may run on ``device``; otherwise a short reason for the log. The
    DSL is imported (once) only for a Hopper device."""
    if device is None or device.type != "cuda":
        return "not a CUDA tensor"
    if not _is_hopper(device):
        return "not an sm_90 GPU (Hopper)"
    return _load_dsl()


def padded_shape(x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The padded grid of a (1, C, T, H, W) input: (1, C, T, H + 2, W + 2)."""
    n, c, t, h, w = x_shape
    return (n, c, t, h + 2, w + 2)


def empty_padded(x_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 bordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(padded, interior)``: a channels-last-3d padded grid for an input of ``x_shape``
    (1, C, T, H, W) with its slack rows allocated and its border zeroed (``bordered``; else
    the caller fills it, e.g. with ``padded_grid_fill``), and the view of its interior,
    (1, C, T, H, W), which the producer writes."""
    _, c, t, h, w = x_shape
    h2, w2 = h + 2, w + 2
    storage = torch.empty(((t * h2 + 3) * w2) * c, dtype=dtype, device=device)
    # The slack rows stay unwritten: only dropped windows read them, and a GEMM row's sum
    # never mixes with another's. Both views in one call each: every tensor view op costs
    # microseconds of host time, and each routed conv of a decode makes a grid.
    strides = (c, 1, h2 * w2 * c, w2 * c, c)  # (1, C, T, H2, W2), channels-last-3d
    padded = storage.as_strided((1, c, t, h2, w2), strides)
    if bordered:
        zero_border(padded)
    return padded, storage.as_strided((1, c, t, h, w), strides, (w2 + 1) * c)


def zero_border(padded: torch.Tensor) -> None:
    """Zero the one-pixel border of every frame of a padded grid (1, C, T, H + 2, W + 2)."""
    padded[:, :, :, 0].zero_()
    padded[:, :, :, -1].zero_()
    padded[:, :, :, 1:-1, 0].zero_()
    padded[:, :, :, 1:-1, -1].zero_()


def pack_padded_grid_weight(weight: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, KT, 3, 3] (or a 2-D [Cout, Cin, 3, 3]) -> [Cout, KT, 3, 3, Cin] contiguous:
    the B operand, its reduction order (channel, dx, dy, dt) innermost first."""
    if weight.dim() == 4:
        weight = weight.unsqueeze(2)
    return weight.permute(0, 2, 3, 4, 1).contiguous()


def padded_grid_conv_reference(padded: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None,
                               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The twin and test oracle: the conv (no padding: the grid's border is the padding) of
    the padded grid ``padded`` (1, C, T_in, H + 2, W + 2) with the stock ``weight``
    [Cout, Cin, KT, 3, 3] in fp32, ``+ bias``, rounded once to the input's dtype,
    channels-last-3d (1, Cout, T_in - KT + 1, H, W); then ``+ residual`` (see
    ``_add_residual``)."""
    y = F.conv3d(padded.float(), weight.float(), None if bias is None else bias.float())
    return _add_residual(y.to(padded.dtype).contiguous(memory_format=torch.channels_last_3d),
                         residual)


def _add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The epilogue's residual add: the rounded conv output plus ``residual`` in fp32, rounded
    again, the two roundings of stock's conv and then its ``x + h``."""
    if residual is None:
        return y
    return (y.float() + residual.float()).to(y.dtype).contiguous(
        memory_format=torch.channels_last_3d)


def padded_grid_gemm_reference(padded: torch.Tensor, packed: torch.Tensor,
                               bias: torch.Tensor | None = None,
                               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's own GEMM in plain torch, fp32: rows of the padded grid, the reduction over
    the affine view of the input (the packed weight's order), the rows whose windows start in
    the padding dropped; the same result as ``padded_grid_conv_reference``. Like the kernel it
    reads the storage's slack rows, so ``padded`` must come from ``empty_padded``. It builds
    the (rows, K) operand: small shapes only (tests)."""
    cout, kt, _, _, c = packed.shape
    _, _, t_in, h2, w2 = padded.shape
    t_out = t_in - kt + 1
    rows = t_out * h2 * w2
    a = padded.as_strided((rows, kt, 3, 3, c), (c, h2 * w2 * c, w2 * c, c, 1),
                          padded.storage_offset())
    y = a.reshape(rows, -1).float() @ packed.reshape(cout, -1).float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.view(t_out, h2, w2, cout)[:, :h2 - 2, :w2 - 2]
    return _add_residual(y.to(padded.dtype).permute(3, 0, 1, 2).unsqueeze(0).contiguous(
        memory_format=torch.channels_last_3d), residual)


def tiling_reason(tiling: Tiling, cin: int, cout: int) -> str | None:
    """Why the kernel cannot run ``tiling`` for ``cin`` -> ``cout`` channels; None if it can."""
    if cin % tiling.block_k or cout % tiling.block_n or tiling.block_k % 16:
        return f"tiling {tiling} does not divide {cin} -> {cout} channels"
    if tiling.block_m % (64 * tiling.warpgroups) or tiling.block_n % 8 or tiling.block_n > 256:
        return f"tiling {tiling} has no warpgroup MMA shape"
    if (tiling.block_m * tiling.block_n // 8) % (128 * tiling.warpgroups):
        return f"tiling {tiling}'s epilogue does not share out over its threads"
    if ring_plan(tiling) is None:
        return f"tiling {tiling} does not fit its share of shared memory"
    return None


def padded_grid_conv_unsupported(padded: torch.Tensor, packed: torch.Tensor,
                                 bias: torch.Tensor | None = None,
                                 residual: torch.Tensor | None = None,
                                 tiling: Tiling | None = None) -> str | None:
    """Why ``padded_grid_conv`` cannot take these tensors (short, for the log); None if it can.
    The tensors' own checks come first, so the (slow, optional) DSL import is tried last."""
    if padded.dim() != 5 or padded.shape[0] != 1:
        return "not a batch-1 5-D input"
    if padded.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        return "not bf16"
    if not padded.is_contiguous(memory_format=torch.channels_last_3d):
        return "input not a dense channels-last-3d padded grid"
    if packed.dim() != 5 or not packed.is_contiguous() or tuple(packed.shape[2:4]) != (3, 3):
        return "weight not packed by pack_padded_grid_weight"
    cout, kt, _, _, cin = packed.shape
    if cin != padded.shape[1]:
        return f"weight takes {cin} channels, input has {padded.shape[1]}"
    if (cin, cout, kt) not in TILINGS:
        return f"{cin} -> {cout} channels, {kt} temporal taps: no measured tiling"
    reason = None if tiling is None else tiling_reason(tiling, cin, cout)
    if reason is not None:
        return reason
    _, _, t_in, h2, w2 = padded.shape
    if t_in < kt or h2 < 3 or w2 < 3:
        return "input smaller than the kernel"
    reach = padded.storage_offset() + padded.numel() + slack_rows(w2 - 2) * cin
    if reach > MAX_ELEMENTS:
        return "2^31 or more input elements"
    if padded.untyped_storage().nbytes() < reach * padded.element_size():
        return "no slack rows after the padded grid (allocate it with empty_padded)"
    if (t_in - kt + 1) * (h2 - 2) * (w2 - 2) * cout > MAX_ELEMENTS:
        return "2^31 or more output elements"
    if bias is not None and (bias.numel() != cout or bias.dtype != torch.float32
                             or bias.device != padded.device):
        return "bias not fp32 of the output's channels on its device"
    if residual is not None and (
            tuple(residual.shape) != (1, cout, t_in - kt + 1, h2 - 2, w2 - 2)
            or residual.dtype != torch.bfloat16 or residual.device != padded.device
            or not residual.is_contiguous(memory_format=torch.channels_last_3d)):
        return "residual not a dense channels-last-3d bf16 tensor of the output's shape"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (padded, packed, bias, residual)):
        return "autograd (the kernel has no backward)"
    return dsl_unavailable_reason(padded.device)


_COMPILED: dict[tuple, object] = {}
_COMPILE_LOCK = threading.Lock()


def _compiled(cin: int, cout: int, kt: int, has_bias: bool, has_residual: bool, stream,
              ffi: bool = False, tiling: Tiling | None = None):
    """The compiled kernel, at ``tiling`` (default: the shape's ``TILINGS`` entry); ``ffi``:
    compiled for TVM FFI calls (``tvm_ffi_reason``), as the positional ``tvm_ffi.Function``
    that takes every argument as a Python int."""
    tiling = tiling or TILINGS[(cin, cout, kt)]
    key = (cin, cout, kt, has_bias, has_residual, ffi, tiling)
    fn = _COMPILED.get(key)
    if fn is None:
        with _COMPILE_LOCK:
            fn = _COMPILED.get(key)
            if fn is None:
                kernel = _KERNEL_CLASS(cin, cout, kt, tiling, has_bias, has_residual)
                null = [_ptr(dt, 0) for dt in (cutlass.BFloat16, cutlass.BFloat16,
                                               cutlass.Float32, cutlass.BFloat16,
                                               cutlass.BFloat16)]
                extra = {"options": "--enable-tvm-ffi"} if ffi else {}
                fn = cute.compile(kernel, *null, cutlass.Int32(1), cutlass.Int32(1),
                                  cutlass.Int32(1), stream, **extra)
                if ffi:
                    # The DSL wraps it for keywords; the positional function under the
                    # wrapper is the one without per-call Python work.
                    fn = getattr(fn, "__tvm_ffi_object__", lambda: fn)() or fn
                _COMPILED[key] = fn
    return fn


# TVM FFI: the DSL's optional calling convention (``apache-tvm-ffi``), where a call hands
# Python ints straight to the compiled host function. The DSL's own call converts each argument
# in Python first: 99-108 us per call against 23-26 through TVM FFI, with the same output bits
# (H100, docs/benchmark/s51). Taken where a caller asks (``padded_grid_conv(ffi=True)``: the Wan
# route's ``padded_grid_tvm_ffi``, on by default).
_FFI_ERROR: str | None = None
_FFI_CHECKED = False


def tvm_ffi_reason() -> str | None:
    """None where ``apache-tvm-ffi`` imports (checked once); otherwise why not."""
    global _FFI_ERROR, _FFI_CHECKED
    if not _FFI_CHECKED:
        with _DSL_LOCK:
            if not _FFI_CHECKED:
                try:
                    import tvm_ffi  # noqa: F401
                except Exception as exc:  # ImportError, or a broken install raising anything
                    _FFI_ERROR = f"no TVM FFI ({type(exc).__name__}: {exc})".splitlines()[0][:160]
                _FFI_CHECKED = True
    return _FFI_ERROR


def _ffi_compiled(cin: int, cout: int, kt: int, has_bias: bool, has_residual: bool,
                  handle: int, tiling: Tiling | None = None):
    """The TVM FFI compile, or None where TVM FFI is missing or its compile failed; a failure
    is kept as ``tvm_ffi_reason``'s answer, so later calls take the DSL's own call at once."""
    if tvm_ffi_reason() is not None:
        return None
    try:
        return _compiled(cin, cout, kt, has_bias, has_residual, _stream(handle), ffi=True,
                         tiling=tiling)
    except Exception as exc:  # an optional path: the DSL's own call still runs the kernel
        _ffi_failed("compile", exc)
        return None


def _ffi_failed(step: str, exc: Exception) -> None:
    """Keep why TVM FFI failed as ``tvm_ffi_reason``'s answer: every later conv then takes the
    DSL's own call without trying again."""
    global _FFI_ERROR
    _FFI_ERROR = f"TVM FFI {step} failed ({type(exc).__name__}: {exc})".splitlines()[0][:160]


def prepare_in_background(device: torch.device, variants=((False, False),),
                          taps: tuple[int, ...] = (1, 3), ffi: bool = False) -> bool:
    """On a Hopper ``device``: import the DSL and compile every ``TILINGS`` kernel of ``taps``
    temporal taps (1: the KL convs, 3: Wan's) in each of ``variants``, (bias, residual) pairs
    (the Wan route's: bias-free, or bias and residual), for TVM FFI calls with ``ffi`` (where it
    is installed), on a thread of its own, so the first decode that takes the route waits on
    neither (~2.3 s of import and 0.3-0.5 s per compile, measured here). Best effort; True if
    started."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        if not _is_hopper(device):
            return False
    except Exception:  # best effort: a device CUDA cannot query is the first call's to judge
        return False

    def work() -> None:
        try:
            if _load_dsl() is None:
                for cin, cout, kt in TILINGS:
                    if kt not in taps:
                        continue
                    for has_bias, has_residual in variants:
                        _compiled(cin, cout, kt, has_bias, has_residual, _cuda.CUstream(0),
                                  ffi=ffi and tvm_ffi_reason() is None)
        except Exception:  # the first call compiles (or declines) instead
            pass

    threading.Thread(target=work, name="fvd-dsl-setup", daemon=True).start()
    return True


def _ptr(dtype, address: int):
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=16)


def padded_grid_conv(padded: torch.Tensor, packed: torch.Tensor,
                     bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None,
                     ffi: bool = False, tiling: Tiling | None = None) -> torch.Tensor | None:
    """The conv of the padded grid ``padded`` (see the module docstring; its storage must
    extend ``slack_rows(W)`` pixel rows past it, as ``empty_padded`` allocates) with the weight
    ``packed`` by ``pack_padded_grid_weight``, ``+ bias`` (fp32) rounded once to bf16, then
    ``+ residual`` (a dense channels-last-3d bf16 tensor of the output's shape, a residual
    block's input) rounded again: a new channels-last-3d (1, Cout, T_in - KT + 1, H, W)
    tensor, or None when unsupported (``padded_grid_conv_unsupported`` says why). ``ffi``: the
    launch goes through TVM FFI where it is installed (``tvm_ffi_reason``), else as without.
    ``tiling``: another than the shape's ``TILINGS`` entry (the per-conv benchmark's sweep, a
    route's ``padded_grid_candidate``)."""
    if padded_grid_conv_unsupported(padded, packed, bias, residual, tiling) is not None:
        return None
    cout, kt, _, _, cin = packed.shape
    _, _, t_in, h2, w2 = padded.shape
    t_out, h, w = t_in - kt + 1, h2 - 2, w2 - 2
    out = torch.empty((1, cout, t_out, h, w), dtype=padded.dtype, device=padded.device,
                      memory_format=torch.channels_last_3d)
    with on_device(padded.device):
        handle = torch.cuda.current_stream().cuda_stream
        fn = _ffi_compiled(cin, cout, kt, bias is not None, residual is not None,
                           handle, tiling) if ffi else None
        if fn is not None:
            # Absent operands get the weight's address, as below.
            w_ptr = packed.data_ptr()
            try:
                fn(padded.data_ptr(), w_ptr, bias.data_ptr() if bias is not None else w_ptr,
                   out.data_ptr(), residual.data_ptr() if residual is not None else w_ptr,
                   t_out, h, w, handle)
                return out
            except Exception as exc:  # e.g. an argument form it refuses: the DSL call runs it
                _ffi_failed("call", exc)
        stream = _stream(handle)
        fn = _compiled(cin, cout, kt, bias is not None, residual is not None, stream,
                       tiling=tiling)
        # Absent operands get the weight's address as a placeholder; the kernel never reads it.
        fn(_ptr(cutlass.BFloat16, padded.data_ptr()), _ptr(cutlass.BFloat16, packed.data_ptr()),
           _ptr(cutlass.Float32, bias.data_ptr() if bias is not None else packed.data_ptr()),
           _ptr(cutlass.BFloat16, out.data_ptr()),
           _ptr(cutlass.BFloat16, residual.data_ptr() if residual is not None
                else packed.data_ptr()), t_out, h, w, stream)
    return out


# The driver's stream handles as the DSL takes them, one per torch stream (a decode uses one or
# two): wrapping the handle anew cost host time on every call.
_STREAMS: dict[int, object] = {}


def _stream(handle: int):
    stream = _STREAMS.get(handle)
    if stream is None:
        if len(_STREAMS) >= 64:  # streams come and go (ComfyUI's offload streams): stay bounded
            _STREAMS.clear()
        stream = _STREAMS[handle] = _cuda.CUstream(handle)
    return stream


def _define_kernel():
    """The kernel class, defined once the DSL is imported (its decorators come from it)."""

    def _load_stage(ring, put, loads) -> None:
        """Warp 0: wait for stage ``put`` to be free, then TMA the next k-tile of A and B into
        it (the stage's barrier counts the bytes). The caller advances ``put``: the DSL
        carries loop state only through assignments it sees in the loop body."""
        tma_a, tag, tas, tma_b, tbg, tbs = loads
        ring.producer_acquire(put)
        bar = ring.producer_get_barrier(put)
        cute.copy(tma_a, tag[(None, put.count)], tas[(None, put.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tbg[(None, put.count)], tbs[(None, put.index)], tma_bar_ptr=bar)

    class _PaddedGridConvKernel:
        """One (channels in, out, temporal taps, tiling); frames and sizes at run time.

        One CTA per output tile. Warp 0 keeps a ring of shared-memory stages filled ahead by
        TMA; the warpgroups run the WGMMAs with one group in flight and hand a stage back when
        the group that read it has finished.
        """

        def __init__(self, cin: int, cout: int, kt: int, tiling: Tiling, has_bias: bool,
                     has_residual: bool):
            self.c, self.n, self.kt, self.has_bias = cin, cout, kt, has_bias
            self.has_residual = has_residual
            self.bm, self.bn, self.bk, self.wgs = (tiling.block_m, tiling.block_n,
                                                   tiling.block_k, tiling.warpgroups)
            self.k = cin * 9 * kt
            self.k_tiles = self.k // self.bk
            plan = ring_plan(tiling)
            assert plan is not None and self.bn % 8 == 0
            self.stages, self.staged_row = plan.stages, plan.staged_row
            self.ctas_per_sm = tiling.ctas_per_sm
            self.threads = 128 * self.wgs
            assert (self.bm * self.bn // 8) % self.threads == 0

        @cute.jit
        def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, bias_ptr: cute.Pointer,
                     out_ptr: cute.Pointer, res_ptr: cute.Pointer, f_out: cutlass.Int32,
                     h: cutlass.Int32, w: cutlass.Int32, stream: _cuda.CUstream):
            c, kt = self.c, self.kt
            h2, w2 = h + 2, w + 2
            rows = f_out * h2 * w2
            # A[q, (ch, dx, dy, dt)]: the padded input at pixel q + dt*h2*w2 + dy*w2 + dx.
            a = cute.make_tensor(x_ptr, cute.make_layout(
                (rows, (c, 3, 3, kt), 1), stride=(c, (1, c, w2 * c, h2 * w2 * c), rows * c)))
            # B[n, (ch, dx, dy, dt)]: the weight packed as [N, KT, 3, 3, C].
            b = cute.make_tensor(w_ptr, cute.make_layout(
                (self.n, (c, 3, 3, kt), 1), stride=(self.k, (1, c, 3 * c, 9 * c), self.n * self.k)))
            out = cute.make_tensor(out_ptr, cute.make_layout((f_out * h * w, self.n),
                                                             stride=(self.n, 1)))
            residual = cute.make_tensor(res_ptr, out.layout)
            bias = cute.make_tensor(bias_ptr, cute.make_layout((self.n,), stride=(1,)))

            tile = (self.bm, self.bn, self.bk)
            k_major = cutlass_utils.LayoutEnum.ROW_MAJOR
            mma = sm90.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, k_major.sm90_mma_major_mode(),
                k_major.sm90_mma_major_mode(), cutlass.Float32, (self.wgs, 1, 1),
                tiler_mn=(64, self.bn))
            sa_layout = sm90.make_smem_layout_a(k_major, tile, cutlass.BFloat16, self.stages)
            sb_layout = sm90.make_smem_layout_b(k_major, tile, cutlass.BFloat16, self.stages)
            load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
                load, a, cute.slice_(sa_layout, (None, None, 0)), (self.bm, self.bk))
            tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
                load, b, cute.slice_(sb_layout, (None, None, 0)), (self.bn, self.bk))

            @cute.struct
            class Smem:
                barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sa: cute.struct.Align[
                    cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sa_layout)], 1024]
                sb: cute.struct.Align[
                    cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sb_layout)], 1024]

            self.smem = Smem
            # One linear grid, column tiles innermost: the CTAs sharing a row tile of A run
            # together and read it while it is in L2 (384 outputs are two 192-wide columns).
            grid = (((rows + self.bm - 1) // self.bm) * (self.n // self.bn), 1, 1)
            self.kernel(tma_a, ta, tma_b, tb, out, bias, residual, mma, sa_layout, sb_layout,
                        rows, h, w).launch(grid=grid, block=[self.threads, 1, 1], stream=stream,
                                           **self._occupancy())

        def _occupancy(self) -> dict:
            """Launch options asking for ``ctas_per_sm`` resident CTAs: the compiler keeps the
            registers to that many, and the carveout (given, so compiling needs no device
            query) leaves shared memory its largest share."""
            if self.ctas_per_sm == 1:
                return {}
            return {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": 100}

        @cute.kernel
        def kernel(self, tma_a: cute.CopyAtom, ta: cute.Tensor, tma_b: cute.CopyAtom,
                   tb: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, residual: cute.Tensor,
                   mma: cute.TiledMma,
                   sa_layout: cute.ComposedLayout, sb_layout: cute.ComposedLayout,
                   rows: cutlass.Int32, h: cutlass.Int32, w: cutlass.Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            bx = bid // (self.n // self.bn)  # row tile
            by = bid - bx * (self.n // self.bn)  # column tile
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

            storage = cutlass.utils.SmemAllocator().allocate(self.smem)
            stage_bytes = (cute.size_in_bytes(cutlass.BFloat16,
                                              cute.slice_(sa_layout, (None, None, 0)))
                           + cute.size_in_bytes(cutlass.BFloat16,
                                                cute.slice_(sb_layout, (None, None, 0))))
            ring = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                # one arrival per warp hands a stage back
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.threads // 32),
                tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            sa = storage.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
            sb = storage.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)

            tile = (self.bm, self.bn, self.bk)
            ga = cute.local_tile(ta, tile, (bx, by, None, 0), proj=(1, None, 1))
            gb = cute.local_tile(tb, tile, (bx, by, None, 0), proj=(None, 1, 1))
            tas, tag = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sa, 0, 2),
                cute.group_modes(ga, 0, 2))
            tbs, tbg = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sb, 0, 2),
                cute.group_modes(gb, 0, 2))

            # Shared-memory operands are a warpgroup's (its first thread's slice); accumulator
            # registers are each thread's own, so their tile coordinates come from the
            # thread's slice.
            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr = mma.get_slice(cute.make_layout(self.wgs, stride=128)(wg))
            fa = mma.make_fragment_A(thr.partition_A(sa))
            fb = mma.make_fragment_B(thr.partition_B(sb))
            coords = mma.get_slice(tidx).partition_C(cute.make_identity_tensor((self.bm, self.bn)))
            acc = cute.make_rmem_tensor(coords.shape, cutlass.Float32)

            put = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            k_tiles = self.k_tiles
            loads = (tma_a, tag, tas, tma_b, tbg, tbs)
            if warp == 0:
                for _ in cutlass.range(min(self.stages, k_tiles), unroll=1):
                    _load_stage(ring, put, loads)
                    put.advance()

            take = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            blocks = cute.size(fa, mode=[2])
            for kt in cutlass.range(k_tiles, unroll=1):
                ring.consumer_wait(take)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(blocks, unroll_full=True):
                    cute.gemm(mma, acc, fa[(None, None, kb, take.index)],
                              fb[(None, None, kb, take.index)], acc)
                    mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                take.advance()
                # The group before this one has finished reading its stage: hand it back, and
                # only then (warp 0) refill one. Warp 0 is also a consumer: at the first k-tile,
                # with every stage full and none handed back, waiting for a free stage would
                # wait on its own release (s47's first GPU run hung there).
                cute.nvgpu.warpgroup.wait_group(1)
                if kt > 0:
                    ring.consumer_release(done)
                    done.advance()
                    if warp == 0 and put.count < k_tiles:
                        _load_stage(ring, put, loads)
                        put.advance()
            cute.nvgpu.warpgroup.wait_group(0)

            # The tile goes through shared memory, so the kept rows leave as 16-byte stores of
            # eight channels: each thread's own accumulators are 2-byte scattered pieces of
            # rows (storing those directly cost 16-25% of the kernel's time, s48 on H200).
            cute.arch.sync_threads()  # every warpgroup's last WGMMA has read the ring
            staged = cute.make_tensor(storage.sa.data_ptr(), cute.make_layout(
                (self.bm, self.bn), stride=(self.staged_row, 1)))
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                r, col = coords[i]
                v = acc[i]
                if cutlass.const_expr(self.has_bias):
                    v = v + bias[by * self.bn + col]
                staged[r, col] = v.to(cutlass.BFloat16)
            cute.arch.sync_threads()
            # Rows whose window starts inside the image go to their pixel of the dense
            # (frames, h, w, n) output; rows in the padding columns and rows are dropped.
            w2 = w + 2
            hw2 = (h + 2) * w2
            chunks = self.bn // 8
            for j in cutlass.range(self.bm * chunks // self.threads, unroll_full=True):
                piece = j * self.threads + tidx
                r = piece // chunks
                chunk = piece - r * chunks
                q = bx * self.bm + r
                f = q // hw2
                rem = q - f * hw2
                y = rem // w2
                x = rem - y * w2
                if q < rows and y < h and x < w:
                    at = ((f * h + y) * w + x, by * chunks + chunk)
                    vec = cute.make_rmem_tensor((1, 8), cutlass.BFloat16)
                    cute.autovec_copy(cute.local_tile(staged, (1, 8), (r, chunk)), vec)
                    if cutlass.const_expr(self.has_residual):
                        # The rounded conv output plus the residual block's input, rounded
                        # again: stock's conv and then its x + h.
                        res = cute.make_rmem_tensor((1, 8), cutlass.BFloat16)
                        cute.autovec_copy(cute.local_tile(residual, (1, 8), at), res)
                        vec.store((vec.load().to(cutlass.Float32)
                                   + res.load().to(cutlass.Float32)).to(cutlass.BFloat16))
                    cute.autovec_copy(vec, cute.local_tile(out, (1, 8), at))

    return _PaddedGridConvKernel


__all__ = [
    "RingPlan",
    "SWEEP_TILINGS",
    "TILINGS",
    "Tiling",
    "dsl_unavailable_reason",
    "empty_padded",
    "pack_padded_grid_weight",
    "padded_grid_conv",
    "padded_grid_conv_reference",
    "padded_grid_conv_unsupported",
    "padded_grid_gemm_reference",
    "padded_shape",
    "prepare_in_background",
    "ring_plan",
    "slack_rows",
    "sweep_tiling",
    "tiling_reason",
]
