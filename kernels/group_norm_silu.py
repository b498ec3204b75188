"""GroupNorm (+ optional SiLU) over channels-last 4-D tensors, statistics split over many programs.

Stock PyTorch GroupNorm computes the statistics with one program per (sample, group): 32 programs
at batch 1 on a 132-SM GPU, which is most of a KL VAE decode. Here, on an NHWC tensor:

1. ``_group_norm_stats_kernel``, grid (splits, N): each program walks a contiguous run of pixels
   (all C channels of each pixel, so loads are contiguous along C) and keeps a Welford mean/M2 per
   register lane; at the end it combines its lanes per group and writes one (mean, M2) partial
   per (n, group, split). Welford, not sum/sum-of-squares: a group can hold millions of elements
   with a mean far from zero, where E[x^2] - E[x]^2 in fp32 cancels catastrophically.
2. ``_group_norm_finalize_kernel``, grid (G, N): combines the partials of one (n, group) with the
   parallel-variance formula (exact, two passes over the small partial row) and folds the affine
   weight/bias into a per-(n, channel) fp32 ``scale`` and ``shift``.
3. ``_group_norm_apply_kernel``, grid (programs, N): each program streams a contiguous run of
   pixel tiles, ``y = x * scale + shift``, SiLU, stored in x.dtype in the input's NHWC order.
   The folded form costs a little accuracy only when |mean| >> std (fp32 rounding of
   mean * scale); at |mean| / std = 1e4 outputs are within ~4e-3 of exact.

Traffic: two reads and one write of x (the minimum for a norm that cannot keep x on chip).

``input_bias``: the norm of ``x + input_bias`` (per channel), with the sum never stored: pass 1
adds it to each loaded element, and since ``(x + b) * scale + shift = x * scale + (shift + b *
scale)`` pass 2 folds it into the shift, so pass 3 is unchanged. A conv whose output feeds only
this norm then needs no bias pass of its own (one read and one write of x fewer), and the sum
is not rounded to x.dtype before its statistics (closer to fp32 than adding first). A norm
without one is launched with a cached zero bias of x's dtype (``_zero_bias``): x + 0 is x (up to
the sign of a zero), and the statistics pass then compiles once per channel count instead of
once with and once without (SDXL's warm-up: 22 variants to 16; the finalize pass, whose channel
counts and affine flags are runtime values, compiles once for all of them: 13).

A residual add handed over (``add_bias_residual_group_stats_``): in a ResnetBlock the sum
``out + bias + residual`` is both the next block's residual and the next GroupNorm's input, so
it is written anyway. Pass 1 can form it (``bias_residual_add``'s order and single rounding),
store it in place of ``out`` and take the statistics of the stored values in the same sweep;
``group_norm_silu(..., stats=)`` then starts at pass 2: five passes over memory instead of six
for add + norm, one launch fewer. The statistics are of the rounded sum, in the same lanes and
splits as pass 1 would take them, so the norm is bit-identical to adding first.

Every per-sample offset is formed in int64 (C*H*W of one sample can exceed 2^31); offsets inside a
tile stay int32.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .accepts import Accepts, autograd_reason, channels_last_4d, pow2, same_layout
from .backend import launch, on_device, tl, triton
from .silu import silu_f32, use_fast_silu

# Tuning knobs for an H200 (bf16; registers as the H200's Triton 3.6 compiled them for sm_90,
# docs/benchmark/s33): a 4096-element stats tile with 4 warps takes 127-128 registers per
# thread (two fp32 Welford accumulators per element), so 4 programs fit on an SM and run in one
# wave, each sweeping a long contiguous run. The variant that also writes a residual sum takes
# 157-164: 3 fit.
STATS_TILE_ELEMENTS = 4096
STATS_PROGRAMS_PER_SM = 4
# The default prefetch mode (PREFETCH_MODES below), "stats": pass 1 loads tile k + 1 before it
# folds in tile k. With one tile in flight per program that pass is latency-bound. Measured
# alone on the norms of a KL decoder (H200, docs/benchmark/s33,
# gnstats.py), it moved 2.21 / 2.64 / 3.40 TB/s at SDXL 1024², SD1.5 768x512 batch 4 and
# SDXL 2048², and 2.34 / 2.84 / 3.79 with the prefetch: -5.6%, -7.0% and -10.3% of the pass.
# Same bits either way. The plain variant stays at 126-128 registers; the residual variant goes
# to 237-238 (2 programs per SM, not 3). The measurement covers both together; prefetching in
# the plain variant alone is not measured yet.
PREFETCH = "stats"
# A register cap for pass 1 (None: ptxas decides). At 128 the residual variant fits 4 programs
# per SM but spills (10-74 bytes). Alone: -0.5 to -1.4%. With the prefetch: +34 to +53%. Both
# from the same measurement. Kept as a switch, off.
STATS_MAXNREG = None
# Apply: 80 registers at 4 warps (Triton 3.8, sm_90), so 6 programs per SM are all resident; each
# loads the per-channel scale/shift once and streams its tiles.
APPLY_TILE_ELEMENTS = 4096
APPLY_PROGRAMS_PER_SM = 6
# The apply pass's own prefetch takes 96 registers at 4 warps (Triton 3.8, sm_90): 5 fit.
APPLY_PREFETCH_PROGRAMS_PER_SM = 5
# Which passes load their next tile before they use the current one (``prefetch=``), by name:
# the GroupNormSiLUConfig fields each mode sets. "stats" is the measured default (above);
# "stats-plain" (the residual-writing variant keeps its 3 programs per SM) and the apply
# pass's modes are prepared, not yet measured.
PREFETCH_MODES: dict[str, dict[str, bool]] = {
    "none": {},
    "stats": {"stats_prefetch": True},
    "stats-plain": {"stats_prefetch": True, "stats_prefetch_residual": False},
    "apply": {"apply_prefetch": True},
    "stats+apply": {"stats_prefetch": True, "apply_prefetch": True},
    "stats-plain+apply": {"stats_prefetch": True, "stats_prefetch_residual": False,
                          "apply_prefetch": True},
}
FINALIZE_BLOCK_S = 512
# The finalize pass's channel tile is at least this wide, so groups of up to 16 channels (every
# KL VAE's 128-512 channels in 32 groups) share one compilation.
FINALIZE_MIN_CPG = 16
# A whole pixel's channels (rounded up to a power of two) must fit one tile row.
MAX_BLOCK_C = 8192
# Groups of a width that is not a power of two are combined through a [groups, channels] mask.
MAX_GROUP_MASK = 32768

# What the kernel takes (``group_norm_silu_unsupported`` and ``fastpath``'s install-time check
# both ask this). Per-sample offsets are int64, but a tile's pixel index is int32.
GROUP_NORM_SILU = Accepts(min_rank=4, max_rank=4, layout=channels_last_4d,
                          max_block_c=MAX_BLOCK_C, max_group_mask=MAX_GROUP_MASK,
                          max_pixels=2**30)


def _is_compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def group_norm_silu_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    eps: float,
    silu: bool = True,
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """GroupNorm (+ SiLU) in plain torch: statistics in fp32, result in x.dtype, x's memory format;
    of ``x + input_bias`` (per channel, added in fp32) where given.

    The test oracle of ``group_norm_silu`` (not a fallback: where the kernel declines, the
    caller runs the stock module); takes any rank >= 2 and any strides.
    """
    n, c = x.shape[:2]
    xf = x.float()
    if input_bias is not None:
        xf = xf + input_bias.to(device=x.device, dtype=torch.float32).reshape((1, c) + (1,) * (x.dim() - 2))
    grouped = xf.reshape(n, num_groups, -1)
    var, mean = torch.var_mean(grouped, dim=-1, unbiased=False, keepdim=True)
    y = (grouped - mean).mul_(torch.rsqrt(var + eps)).reshape(xf.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y.mul_(weight.to(device=x.device, dtype=torch.float32).reshape(shape))
    if bias is not None:
        y = y.add_(bias.to(device=x.device, dtype=torch.float32).reshape(shape))
    if silu:
        y = F.silu(y, inplace=True)
    fmt = torch.channels_last if channels_last_4d(x) else torch.contiguous_format
    return y.to(dtype=x.dtype, memory_format=fmt)


class GroupNormSiLUConfig(NamedTuple):
    """Launch parameters; block sizes are powers of two."""

    stats_block_p: int  # pixels per stats tile (the tile holds all channels of each pixel)
    stats_programs: int  # stats programs per sample wanted (fewer when there are fewer tiles)
    stats_warps: int
    apply_block_p: int  # pixels per apply tile
    apply_programs: int  # apply programs per sample wanted (each loops over its tiles)
    apply_warps: int
    finalize_block_s: int  # partials read per finalize step
    finalize_warps: int
    stats_prefetch: bool = False  # pass 1 loads tile k + 1 before it uses tile k
    stats_maxnreg: int | None = None  # pass 1's register cap per thread (None: ptxas decides)
    apply_prefetch: bool = False  # pass 3 loads tile t + 1 before it uses tile t
    stats_prefetch_residual: bool = True  # stats_prefetch also where a residual is read
    fast_silu: bool = False  # the apply pass's SiLU in its MUFU form (``kernels.silu``)


@functools.lru_cache(maxsize=None)
def _zero_bias(c: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Kept for the process (C elements per channel count, device and dtype; never freed, so it
    may be read on any stream). x's dtype: a bias of another dtype is another variant."""
    return torch.zeros(c, device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so tests exercise the split statistics


@functools.lru_cache(maxsize=512)
def group_norm_silu_config(
    n: int, c: int, hw: int, num_groups: int, sm_count: int, prefetch: str | None = None,
    fast_silu: bool = False,
) -> GroupNormSiLUConfig:
    """The default launch parameters for an (n, c, h*w) problem on a GPU with ``sm_count`` SMs;
    ``prefetch``: a ``PREFETCH_MODES`` name (None: ``PREFETCH``); ``fast_silu``: SiLU's MUFU
    form where the device takes it (``kernels.silu``)."""
    mode = PREFETCH_MODES[PREFETCH if prefetch is None else prefetch]
    apply_per_sm = APPLY_PREFETCH_PROGRAMS_PER_SM if mode.get("apply_prefetch") else \
        APPLY_PROGRAMS_PER_SM
    stats_c = pow2(c)
    stats_block_p = max(1, STATS_TILE_ELEMENTS // stats_c)
    # Enough programs to fill the GPU at batch 1; more only add partials for pass 2 to combine.
    stats_programs = max(1, (STATS_PROGRAMS_PER_SM * sm_count) // max(1, n))
    stats_warps = 4 if stats_block_p * stats_c <= 4096 else 8
    cpg = c // num_groups
    if cpg & (cpg - 1):
        # The [groups, channels] membership mask spills at 4 warps (C=320); at 8 it takes ~180
        # registers, one program per SM: slow but correct, and no KL VAE has such groups.
        stats_warps = 8
    apply_c = pow2(c)
    apply_block_p = max(1, APPLY_TILE_ELEMENTS // apply_c)
    apply_warps = 4 if apply_block_p * apply_c <= 4096 else 8
    return GroupNormSiLUConfig(
        stats_block_p=stats_block_p,
        stats_programs=stats_programs,
        stats_warps=stats_warps,
        apply_block_p=apply_block_p,
        apply_programs=max(1, (apply_per_sm * sm_count) // max(1, n)),
        apply_warps=apply_warps,
        finalize_block_s=FINALIZE_BLOCK_S,
        finalize_warps=4,
        stats_maxnreg=STATS_MAXNREG,
        fast_silu=bool(fast_silu),
        **mode,
    )


def _param_reason(name: str, p: torch.Tensor | None, x: torch.Tensor) -> str | None:
    if p is None:
        return None
    if p.device != x.device:
        return f"{name} on {p.device}, input on {x.device}"
    if p.numel() != x.shape[1]:
        return f"{name} has {p.numel()} elements for {x.shape[1]} channels"
    if not p.is_floating_point():
        return f"{name} dtype {p.dtype}"
    return None


def group_norm_silu_unsupported(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    input_bias: torch.Tensor | None = None,
) -> str | None:
    """Why the Triton path cannot take this input (short, for the UI and log); None if it can."""
    reason = (GROUP_NORM_SILU.tensor_reason(x)
              or GROUP_NORM_SILU.channels_reason(x.shape[1], num_groups))
    if reason is not None:
        return reason
    for name, p in (("weight", weight), ("bias", bias), ("input bias", input_bias)):
        reason = _param_reason(name, p, x)
        if reason is not None:
            return reason
    reason = autograd_reason(x, weight, bias, input_bias)
    if reason is not None:
        return reason
    if _is_compiling():
        return "torch.compile tracing"
    return None


class _LaunchPlan(NamedTuple):
    splits: int  # stats programs per sample (each at least one pixel: no empty partial)
    pix_per_program: int
    apply_programs: int
    apply_tiles_per_program: int
    block_g: int
    block_cpg: int
    parts: int  # workspace floats per partial array, rounded up for 16-byte alignment
    chans: int  # workspace floats per scale/shift array, likewise


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # host arithmetic: triton.cdiv costs microseconds per call from Python


@functools.lru_cache(maxsize=512)
def _launch_plan(n: int, c: int, hw: int, num_groups: int, config: GroupNormSiLUConfig) -> _LaunchPlan:
    """Grid sizes and workspace layout for one problem; memoized (a decode repeats a few shapes
    many times, and the host time per launch is what a launch-bound decode waits on)."""
    for v in (config.stats_block_p, config.apply_block_p, config.finalize_block_s):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"block sizes must be powers of two: {config}")
    chunks_per_program = _cdiv(_cdiv(hw, config.stats_block_p), max(1, config.stats_programs))
    pix_per_program = chunks_per_program * config.stats_block_p
    splits = _cdiv(hw, pix_per_program)
    tiles_per_program = _cdiv(_cdiv(hw, config.apply_block_p), max(1, config.apply_programs))
    apply_programs = _cdiv(hw, tiles_per_program * config.apply_block_p)
    return _LaunchPlan(splits, pix_per_program, apply_programs, tiles_per_program,
                       pow2(num_groups), pow2(c // num_groups),
                       _cdiv(n * num_groups * splits, 4) * 4, _cdiv(n * c, 4) * 4)


class GroupStats(NamedTuple):
    """Pass 1's partial statistics of one tensor, for ``group_norm_silu(..., stats=)``."""

    problem: tuple  # (n, c, hw, num_groups, config): the launch plan they were taken with
    part_mean: torch.Tensor
    part_m2: torch.Tensor


def add_bias_residual_group_stats_(
    out: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    *,
    config: GroupNormSiLUConfig | None = None,
    prefetch: str | None = None,
) -> GroupStats | None:
    """``out += bias (+ residual)`` in place, rounded once as ``bias_residual_add_`` does, and
    the group statistics of the result (the module's note); None, with ``out`` untouched, where
    ``group_norm_silu_unsupported`` or the residual's layout says no. ``config`` and
    ``prefetch`` as for ``group_norm_silu``, which must get the same to take the statistics."""
    if group_norm_silu_unsupported(out, None, None, num_groups, bias) is not None:
        return None
    if residual is not None and (not same_layout(residual, out) or residual.dtype != out.dtype
                                 or residual.device != out.device
                                 or autograd_reason(residual) is not None):
        return None
    n, c, h, w = out.shape
    if config is None:
        config = group_norm_silu_config(n, c, h * w, num_groups, _sm_count(out.device), prefetch)
    plan = _launch_plan(n, c, h * w, num_groups, config)
    ws = torch.empty(2 * plan.parts, device=out.device, dtype=torch.float32)
    part_mean, part_m2 = ws[:plan.parts], ws[plan.parts:]
    _launch_stats(out, bias, residual, part_mean, part_m2, num_groups, config, plan,
                  write_sum=True)
    return GroupStats(_stats_problem(n, c, h * w, num_groups, config), part_mean, part_m2)


def _stats_problem(n: int, c: int, hw: int, num_groups: int, config: GroupNormSiLUConfig) -> tuple:
    """What handed-over statistics must match: the problem and the plan, less the SiLU form
    (the apply pass's alone, so a norm with either form takes statistics taken without it). The
    plan itself where it has no form to drop: this runs twice per norm on the host."""
    return (n, c, hw, num_groups, config._replace(fast_silu=False) if config.fast_silu else config)


def _launch_stats(x, in_bias, residual, part_mean, part_m2, num_groups, config, plan,
                  write_sum: bool) -> None:
    n, c, h, w = x.shape
    in_bias = _zero_bias(c, x.device, x.dtype) if in_bias is None else in_bias.contiguous()
    with on_device(x.device):
        launch(_group_norm_stats_kernel, (plan.splits, n),
            x, in_bias, residual if residual is not None else x,  # unused unless HAS_RES
            part_mean, part_m2, h * w, plan.pix_per_program, plan.splits,
            C=c, G=num_groups, CPG=c // num_groups, HAS_IN_BIAS=True,
            HAS_RES=residual is not None, WRITE_SUM=write_sum,
            BLOCK_P=config.stats_block_p, BLOCK_C=pow2(c), BLOCK_G=plan.block_g,
            PREFETCH=bool(config.stats_prefetch)
            and (residual is None or bool(config.stats_prefetch_residual)),
            num_warps=config.stats_warps,
            **({} if config.stats_maxnreg is None else {"maxnreg": config.stats_maxnreg}),
        )


class NormSiLU(NamedTuple):
    """A norm folded to per-(sample, channel) fp32 factors, [n, C] each: the input a consumer
    reads is ``silu(x * scale + shift)`` rounded to x's dtype (``silu`` False: without SiLU).
    What ``group_norm_scale_shift`` returns for a consumer that applies the norm itself while
    it reads x (``narrow_conv``'s ``prologue``), so x's normalised copy is never written."""

    scale: torch.Tensor
    shift: torch.Tensor
    silu: bool = True


def group_norm_scale_shift(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    eps: float,
    silu: bool = True,
    *,
    input_bias: torch.Tensor | None = None,
    config: GroupNormSiLUConfig | None = None,
    stats: GroupStats | None = None,
    prefetch: str | None = None,
) -> NormSiLU | None:
    """Passes 1 and 2 of ``group_norm_silu`` (the same arguments, the same statistics and
    factors): the norm as a ``NormSiLU`` for a consumer that applies it while reading x; None
    where ``group_norm_silu_unsupported`` gives a reason."""
    if group_norm_silu_unsupported(x, weight, bias, num_groups, input_bias) is not None:
        return None
    n, c, h, w = x.shape
    if config is None:
        config = group_norm_silu_config(n, c, h * w, num_groups, _sm_count(x.device), prefetch)
    plan = _launch_plan(n, c, h * w, num_groups, config)
    scale, shift = _scale_shift(x, weight, bias, num_groups, eps, input_bias, config, plan, stats)
    return NormSiLU(scale.view(n, c), shift.view(n, c), bool(silu))


def _scale_shift(x, weight, bias, num_groups, eps, input_bias, config, plan, stats):
    """Passes 1 (unless ``stats`` were handed over for this problem) and 2 under the caller's
    launch ``plan``: the per-channel fp32 scale and shift, each ``n * C`` long."""
    n, c, h, w = x.shape
    hw = h * w
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    input_bias = None if input_bias is None else input_bias.contiguous()
    if stats is not None and (input_bias is not None or stats.part_mean.device != x.device
                              or stats.problem != _stats_problem(n, c, hw, num_groups, config)):
        stats = None  # taken for another problem or plan (or x + input_bias was asked)
    # One fp32 workspace (one allocator call): partial means and M2s [n, G, splits] (unless
    # handed over), then the per-channel scale and shift [n, C]; each piece starts 16-byte
    # aligned for vector loads.
    parts = 0 if stats is not None else plan.parts
    chans = plan.chans
    ws = torch.empty(2 * parts + 2 * chans, device=x.device, dtype=torch.float32)
    if stats is not None:
        part_mean, part_m2 = stats.part_mean, stats.part_m2
    else:
        part_mean, part_m2 = ws[:parts], ws[parts : 2 * parts]
    scale = ws[2 * parts : 2 * parts + n * c]
    shift = ws[2 * parts + chans : 2 * parts + chans + n * c]

    # A zero bias where none is given: one variant of each pass (the module's note).
    in_bias = input_bias if input_bias is not None else _zero_bias(c, x.device, x.dtype)
    if stats is None:
        _launch_stats(x, in_bias, None, part_mean, part_m2, num_groups, config, plan,
                      write_sum=False)
    with on_device(x.device):
        launch(_group_norm_finalize_kernel, (num_groups, n),
            part_mean, part_m2,
            # An absent weight or bias is never read; its stand-in is one of the norm's own
            # operands, so a pointer of another dtype makes no variant of its own.
            weight if weight is not None else (bias if bias is not None else in_bias),
            bias if bias is not None else (weight if weight is not None else in_bias),
            in_bias,
            scale, shift, hw, plan.pix_per_program, plan.splits, float(eps),
            c, num_groups, c // num_groups, int(weight is not None), int(bias is not None),
            # Not sized to splits or to narrow groups: one variant for every norm of a decoder.
            BLOCK_S=config.finalize_block_s, BLOCK_CPG=max(plan.block_cpg, FINALIZE_MIN_CPG),
            num_warps=config.finalize_warps,
        )
    return scale, shift


def group_norm_silu(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    eps: float,
    silu: bool = True,
    *,
    input_bias: torch.Tensor | None = None,
    config: GroupNormSiLUConfig | None = None,
    stats: GroupStats | None = None,
    prefetch: str | None = None,
    fast_silu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """GroupNorm (+ SiLU) of a channels-last x (of ``x + input_bias`` where given, see the
    module's note); a new channels-last tensor of x.dtype, or ``out`` written (``out_reason``:
    channels-last pixels whose rows and images may lie further apart, a padded grid's interior).

    ``stats``: pass 1's statistics of x as ``add_bias_residual_group_stats_`` took them while
    writing x; used where they were taken for this problem and launch plan, else pass 1 runs.
    The caller vouches that x has not changed since. Returns None when
    ``group_norm_silu_unsupported`` gives a reason: the caller falls back to the stock module.
    ``config`` overrides the heuristic; ``prefetch`` names the heuristic's ``PREFETCH_MODES``
    entry (None: ``PREFETCH``); ``fast_silu`` asks the heuristic for SiLU's MUFU form. Neither
    changes the statistics, so handed-over ones match either form.
    """
    if (group_norm_silu_unsupported(x, weight, bias, num_groups, input_bias) is not None
            or out_reason(out, x) is not None):
        return None
    n, c, h, w = x.shape
    hw = h * w
    if config is None:
        config = group_norm_silu_config(n, c, hw, num_groups, _sm_count(x.device), prefetch,
                                        fast_silu)
    plan = _launch_plan(n, c, hw, num_groups, config)
    scale, shift = _scale_shift(x, weight, bias, num_groups, eps, input_bias, config, plan, stats)
    dense = out is None or out.is_contiguous(memory_format=torch.channels_last)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.channels_last)
    with on_device(x.device):
        launch(_group_norm_apply_kernel, (plan.apply_programs, n),
            x, out, scale, shift, hw, plan.apply_tiles_per_program, int(bool(silu)),
            w, out.stride(2), out.stride(0),
            C=c, BLOCK_P=config.apply_block_p, BLOCK_C=pow2(c),
            PREFETCH=bool(config.apply_prefetch),
            FAST_SILU=use_fast_silu(config.fast_silu, x.device), STRIDED_OUT=not dense,
            num_warps=config.apply_warps,
        )
    return out


def out_reason(out: torch.Tensor | None, x: torch.Tensor) -> str | None:
    """Why ``group_norm_silu`` cannot write into ``out`` (None if it can, or none is given):
    x's shape, dtype and device, each pixel's channels contiguous and pixels of a row C apart
    (rows and images may lie further apart: the interior of a padded grid)."""
    if out is None:
        return None
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        return "out differs from the input in shape, dtype or device"
    n, c, h, w = x.shape
    if (c > 1 and out.stride(1) != 1) or (w > 1 and out.stride(3) != c):
        return "out's pixels are not rows of contiguous channels"
    if (h > 1 and out.stride(2) < w * c) or (n > 1 and out.stride(0) < h * out.stride(2)):
        return "out's rows or images overlap"
    return None


# Sizes and loop counts are plain runtime ints (``do_not_specialize``): left to Triton's default,
# each distinct divisibility-by-16 pattern of them is a separate compilation (~0.3 s each on an
# H200 host), and one decode meets several. Alignment comes from the constexpr C (a multiple of
# 16 in every VAE), so the loads vectorize without them.
if triton is not None:

    @triton.jit
    def _written_sum(x, x_ptrs, res, mask, HAS_RES: tl.constexpr):
        """Pass 1 under WRITE_SUM: the tile (input bias added) + the residual tile ``res`` (as
        loaded), stored in x's dtype, and read back as stored (its statistics are of what the
        next pass reads)."""
        if HAS_RES:
            x += res.to(tl.float32)
        stored = x.to(x_ptrs.dtype.element_ty)
        tl.store(x_ptrs, stored, mask=mask)
        return stored.to(tl.float32)

    @triton.jit(do_not_specialize=["HW", "PIX_PER_PROGRAM", "SPLITS"])
    def _group_norm_stats_kernel(
        x_ptr, in_bias_ptr, res_ptr, mean_ptr, m2_ptr, HW, PIX_PER_PROGRAM, SPLITS,
        C: tl.constexpr, G: tl.constexpr, CPG: tl.constexpr, HAS_IN_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr, WRITE_SUM: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        # WRITE_SUM: x := round(x + in_bias (+ res)) stored in place, statistics of the stored
        # values (``add_bias_residual_group_stats_``); else statistics of x (+ in_bias), x kept.
        split = tl.program_id(0)
        n = tl.program_id(1)
        p0 = split * PIX_PER_PROGRAM
        npix = tl.minimum(HW - p0, PIX_PER_PROGRAM)
        nfull = npix // BLOCK_P
        rem = npix - nfull * BLOCK_P

        offs_p = tl.arange(0, BLOCK_P)[:, None]
        c = tl.arange(0, BLOCK_C)
        c_ok = (c < C)[None, :]
        tile = offs_p * C + c[None, :]
        base = (n.to(tl.int64) * HW + p0) * C
        ptr = x_ptr + base

        # One Welford accumulator per lane (pixel slot, channel); groups only matter when the
        # lanes are combined at the end. Every valid lane has seen k + 1 values after full tile k,
        # so the update weight is a scalar there.
        mean = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        # Padded channels get 0 as their bias: their lanes count nothing (cnt below).
        in_bias = tl.zeros([1, BLOCK_C], dtype=tl.float32)
        if HAS_IN_BIAS:
            in_bias += tl.load(in_bias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        rptr = res_ptr + base
        if PREFETCH:
            # Tile k + 1 is loaded before tile k is used: two tiles in flight per program, not
            # one (the note above PREFETCH has the measurement).
            first_ok = c_ok & (nfull > 0)
            x_next = tl.load(ptr + tile, mask=first_ok, other=0.0)
            res_next = x_next
            if HAS_RES:
                res_next = tl.load(rptr + tile, mask=first_ok, other=0.0)
        for k in range(nfull):
            if PREFETCH:
                x_raw = x_next
                res = res_next
                next_ok = c_ok & (k + 1 < nfull)
                x_next = tl.load(ptr + BLOCK_P * C + tile, mask=next_ok, other=0.0)
                if HAS_RES:
                    res_next = tl.load(rptr + BLOCK_P * C + tile, mask=next_ok, other=0.0)
            else:
                if BLOCK_C == C:
                    x_raw = tl.load(ptr + tile)
                else:
                    x_raw = tl.load(ptr + tile, mask=c_ok, other=0.0)
                res = x_raw
                if HAS_RES:
                    res = tl.load(rptr + tile, mask=c_ok, other=0.0)
            x = x_raw.to(tl.float32)
            if HAS_IN_BIAS:
                x += in_bias
            if WRITE_SUM:
                x = _written_sum(x, ptr + tile, res, c_ok, HAS_RES)
            delta = x - mean
            mean += delta * (1.0 / (k + 1.0))
            m2 += delta * (x - mean)
            ptr += BLOCK_P * C
            rptr += BLOCK_P * C
        pix_ok = offs_p < rem
        if rem > 0:
            ok = pix_ok & c_ok
            x = tl.load(ptr + tile, mask=ok, other=0.0).to(tl.float32)
            if HAS_IN_BIAS:
                x += in_bias
            if WRITE_SUM:
                res = x
                if HAS_RES:
                    res = tl.load(rptr + tile, mask=ok, other=0.0)
                x = _written_sum(x, ptr + tile, res, ok, HAS_RES)
            delta = x - mean
            mean += tl.where(ok, delta * (1.0 / (nfull + 1.0)), 0.0)
            m2 += tl.where(ok, delta * (x - mean), 0.0)

        # Combine lanes with the exact parallel formulas (n-weighted mean, then M2 about it):
        # first each channel's pixel slots, then each group's channels.
        cnt = ((nfull + pix_ok.to(tl.int32)) * c_ok.to(tl.int32)).to(tl.float32)
        cnt = tl.broadcast_to(cnt, [BLOCK_P, BLOCK_C])
        cnt_c = tl.sum(cnt, axis=0)
        mean_c = tl.sum(cnt * mean, axis=0) / tl.maximum(cnt_c, 1.0)
        d = mean - mean_c[None, :]
        m2_c = tl.sum(m2 + cnt * d * d, axis=0)
        if BLOCK_C == BLOCK_G * CPG:
            # Power-of-two group width: channel c = g * CPG + j is a plain reshape.
            cnt_gc = tl.reshape(cnt_c, [BLOCK_G, CPG])
            mean_gc = tl.reshape(mean_c, [BLOCK_G, CPG])
            m2_gc = tl.reshape(m2_c, [BLOCK_G, CPG])
        else:
            # Other widths (C=96 or 320 with 32 groups): a [groups, channels] membership mask.
            member = (c[None, :] // CPG == tl.arange(0, BLOCK_G)[:, None]) & (c < C)[None, :]
            cnt_gc = tl.where(member, cnt_c[None, :], 0.0)
            mean_gc = tl.where(member, mean_c[None, :], 0.0)
            m2_gc = tl.where(member, m2_c[None, :], 0.0)
        cnt_g = tl.sum(cnt_gc, axis=1)
        mean_g = tl.sum(cnt_gc * mean_gc, axis=1) / tl.maximum(cnt_g, 1.0)
        d = mean_gc - mean_g[:, None]
        m2_g = tl.sum(m2_gc + cnt_gc * d * d, axis=1)

        g = tl.arange(0, BLOCK_G)
        out = (n * G + g) * SPLITS + split
        tl.store(mean_ptr + out, mean_g, mask=g < G)
        tl.store(m2_ptr + out, m2_g, mask=g < G)

    # A few microseconds per norm: its channel counts and affine flags are runtime values, so
    # every norm of a decoder shares one compilation (a constexpr C cost SDXL three).
    @triton.jit(do_not_specialize=["HW", "PIX_PER_PROGRAM", "SPLITS", "C", "G", "CPG",
                                   "has_weight", "has_bias"])
    def _group_norm_finalize_kernel(
        mean_ptr, m2_ptr, w_ptr, b_ptr, in_bias_ptr, scale_ptr, shift_ptr,
        HW, PIX_PER_PROGRAM, SPLITS, eps, C, G, CPG, has_weight, has_bias,
        BLOCK_S: tl.constexpr, BLOCK_CPG: tl.constexpr,
    ):
        g = tl.program_id(0)
        n = tl.program_id(1)
        row = (n * G + g) * SPLITS
        total = (HW * 1.0) * CPG

        # Parallel-variance combination, two passes over the row: mean = sum(n_s m_s) / N,
        # M2 = sum(M2_s + n_s (m_s - mean)^2). Split s holds min(HW - s*P, P) pixels.
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for s0 in range(0, SPLITS, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ok = s < SPLITS
            cnt = tl.where(ok, tl.minimum(HW - s * PIX_PER_PROGRAM, PIX_PER_PROGRAM), 0)
            m = tl.load(mean_ptr + row + s, mask=ok, other=0.0)
            acc += cnt.to(tl.float32) * CPG * m
        mean = tl.sum(acc, axis=0) / total
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for s0 in range(0, SPLITS, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ok = s < SPLITS
            cnt = tl.where(ok, tl.minimum(HW - s * PIX_PER_PROGRAM, PIX_PER_PROGRAM), 0)
            m = tl.load(mean_ptr + row + s, mask=ok, other=0.0)
            m2 = tl.load(m2_ptr + row + s, mask=ok, other=0.0)
            d = m - mean
            acc += m2 + cnt.to(tl.float32) * CPG * d * d
        var = tl.maximum(tl.sum(acc, axis=0) / total, 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)

        j = tl.arange(0, BLOCK_CPG)
        c = g * CPG + j
        ok = j < CPG
        scale = tl.zeros([BLOCK_CPG], dtype=tl.float32) + rstd
        if has_weight != 0:
            scale *= tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        shift = -mean * scale
        if has_bias != 0:
            shift += tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        # The input bias (a zero one where none was given): the apply pass reads x without it,
        # (x + b) * scale = x * scale + b * scale.
        shift += tl.load(in_bias_ptr + c, mask=ok, other=0.0).to(tl.float32) * scale
        tl.store(scale_ptr + n * C + c, scale, mask=ok)
        tl.store(shift_ptr + n * C + c, shift, mask=ok)

    # SiLU is a runtime flag (a uniform branch per tile): a norm without it (the attention's)
    # shares its width's compilation.
    @triton.jit
    def _apply_store(y, y_ptr, dense_ptrs, mask, silu, n, pp, c, OUT_W, out_row, out_img,
                     C: tl.constexpr, FAST_SILU: tl.constexpr, STRIDED_OUT: tl.constexpr):
        """SiLU (where asked) and the store of an apply tile: at ``dense_ptrs`` (x's own
        layout), or under STRIDED_OUT at pixels ``pp`` (a column of per-image pixel indices) of
        an output whose pixel rows are ``out_row`` apart and images ``out_img`` (a padded grid's
        interior): each pixel's C channels stay contiguous, so stores still vectorize."""
        if silu != 0:
            y = silu_f32(y, FAST_SILU)
        if STRIDED_OUT:
            row = pp // OUT_W
            col = pp - row * OUT_W
            dst = y_ptr + (n.to(tl.int64) * out_img + row.to(tl.int64) * out_row + col * C + c)
        else:
            dst = dense_ptrs
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=mask)

    # SiLU is a runtime flag (a uniform branch per tile): a norm without it (the attention's)
    # shares its width's compilation. STRIDED_OUT: y is not x's dense layout but pixel rows
    # ``out_row`` and images ``out_img`` elements apart, rows of ``OUT_W`` pixels.
    # The output's strides are runtime values, as every size here: that is the form that ran
    # on a GPU (s49). It hides their divisibility, so a strided out (the KL grid route's, off)
    # is stored two bytes at a time: the apply pass took 4.02 ms of an H100 SDXL 1024² decode
    # into grids, where the dense one takes ~3. Specializing them (Triton's divisibility by 16)
    # is the fix to measure with that route.
    @triton.jit(do_not_specialize=["HW", "TILES_PER_PROGRAM", "silu", "OUT_W", "out_row",
                                   "out_img"])
    def _group_norm_apply_kernel(
        x_ptr, y_ptr, scale_ptr, shift_ptr, HW, TILES_PER_PROGRAM, silu, OUT_W, out_row, out_img,
        C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr,
        FAST_SILU: tl.constexpr, STRIDED_OUT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n = tl.program_id(1)
        p = tl.arange(0, BLOCK_P)[:, None]
        c = tl.arange(0, BLOCK_C)[None, :]
        c_ok = c < C
        # Loaded once per program and reused over its tiles (a tile is only a few pixels wide).
        scale = tl.load(scale_ptr + n * C + c, mask=c_ok, other=0.0)
        shift = tl.load(shift_ptr + n * C + c, mask=c_ok, other=0.0)
        p0 = pid * TILES_PER_PROGRAM * BLOCK_P
        if PREFETCH:
            # Tile t + 1 is loaded before tile t is used (``apply_prefetch``). The run's base is
            # one int64 per program and the tile's offsets int32, so the second tile in flight
            # costs fewer registers than a tile of int64 offsets would.
            base = (n.to(tl.int64) * HW + p0) * C
            xp = x_ptr + base
            yp = y_ptr + base
            tile = p * C + c
            left = HW - p0
            x_next = tl.load(xp + tile, mask=(p < left) & c_ok & (TILES_PER_PROGRAM > 0),
                             other=0.0)
            for t in range(TILES_PER_PROGRAM):
                mask = (p < left - t * BLOCK_P) & c_ok
                x = x_next.to(tl.float32)
                x_next = tl.load(xp + BLOCK_P * C + tile,
                                 mask=(p < left - (t + 1) * BLOCK_P) & c_ok
                                 & (t + 1 < TILES_PER_PROGRAM), other=0.0)
                _apply_store(x * scale + shift, y_ptr, yp + tile, mask, silu, n,
                             p0 + t * BLOCK_P + p, c, OUT_W, out_row, out_img, C, FAST_SILU,
                             STRIDED_OUT)
                xp += BLOCK_P * C
                yp += BLOCK_P * C
        else:
            offs = (n.to(tl.int64) * HW + p0) * C + p * C + c
            for t in range(TILES_PER_PROGRAM):
                mask = (p < HW - p0 - t * BLOCK_P) & c_ok
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                _apply_store(x * scale + shift, y_ptr, y_ptr + offs, mask, silu, n,
                             p0 + t * BLOCK_P + p, c, OUT_W, out_row, out_img, C, FAST_SILU,
                             STRIDED_OUT)
                offs += BLOCK_P * C
