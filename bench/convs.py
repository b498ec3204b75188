"""The per-conv benchmark: every distinct convolution of the bench cases' decoders, timed as the
fused path runs it on cuDNN against the pack's own ``implicit_gemm_conv`` (and, for 2-D 3x3
convs, ``winograd_conv``: F(4x4, 3x3) with its 36 products on cuBLAS).

Shapes are collected with forward hooks on the diffusers decoders of each case's architecture,
built and run on the meta device (no memory, no arithmetic: seconds per case), so the list
follows the real architectures and latent sizes (``bench.cases``). An architecture diffusers
does not build the way ComfyUI does (LTX-2: ``RECORDED_ARCHS``) is recorded instead: one
``high`` decode of the case on ComfyUI's own model through the node, every conv call the fused
path makes noted as it is made (``recording_convs``), so those shapes are the fused path's by
construction. Each hooked conv is recorded as the fused path runs it (``ConvShape.route``):

- KL ``Upsample`` convs run as one 4x4 stride-2 ``conv_transpose2d`` on the low-resolution
  input (``upsample_conv_fold``), Wan's ``Resample`` convs likewise per frame;
- a Wan causal conv reads its cached frames (or zero frames) in front of the new ones: input
  frames = new + kernel - 1; the first chunk's single uncached frame meets only the last
  temporal tap (the pack's ``causal_zero`` taps);
- narrow batch-1 3x3x3 convs run as three 2-D convs over frame views (``wan.ops.tap_parts``),
  and, with ``stacked_taps`` set, those at ``wan.ops.STACKED_TAPS_MIN_PIXELS`` as one 2-D conv
  over a channel-stacked input (``kernels.stacked_taps``);
- a 4-channel latent's ``conv_in`` runs in the stock layout (``kl.decoder._conv_in_layout``).

cuDNN runs channels-last(-3d) bf16 against channels-last weights, without bias (the pack adds
conv biases in the following fused pass); ``implicit_gemm_conv`` includes the bias.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

import torch

from ..fastpath.families.wan.ops import single_tap_2d_shape, stacked_taps_shape
from ..fastpath.families.wan.settings import settings as wan_settings
from .cases import Case

SCHEMA = "fast_vae_decode.convs/1"
# The cases issue 13 names that need no ComfyUI; LTX-2's (RECORDED_ARCHS) need ``--comfyui``.
CONV_CASES = ("sdxl-1024", "flux-1024", "wan21-480p-33", "wan22-704p-33")
# Decoders whose convs are recorded from a fused decode on ComfyUI's model, not from diffusers.
RECORDED_ARCHS = ("ltx2",)
NARROW_TAPS = 128  # wan.ops.TAPS_MAX_CHANNELS: 3x3x3 convs up to this width run as 2-D taps


@dataclass(frozen=True)
class ConvShape:
    """One convolution as the fused path runs it. 2-D: ``input`` (N, C, H, W), ``kernel``
    (KH, KW); 3-D: (N, C, T, H, W) and (KT, KH, KW); ``padding`` per spatial axis."""

    kind: str  # conv_in | head | 3x3 | 1x1 | upsample (4x4/2 folded) | causal 3x3x3 | ...
    # the pack's cuDNN call today: conv2d | conv2d-nchw | conv3d | taps | stacked | transposed
    route: str
    input: tuple[int, ...]
    cout: int
    kernel: tuple[int, ...]
    padding: tuple[int, ...]

    @property
    def output(self) -> tuple[int, ...]:
        if self.route == "transposed":
            n, _, h, w = self.input
            return (n, self.cout, 2 * h, 2 * w)
        spatial = [s + 2 * p - k + 1 for s, p, k in
                   zip(self.input[2:], self.padding, self.kernel, strict=True)]
        return (self.input[0], self.cout, *spatial)

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the operation run (the folded upsample: 4 taps per output)."""
        taps = 4 if self.route == "transposed" else math.prod(self.kernel)
        return 2 * self.input[1] * self.cout * taps * math.prod(self.output[2:]) * self.input[0]

    @property
    def kernel_text(self) -> str:
        """The kernel as the tables print it (the folded upsample: its 4x4 stride-2 conv)."""
        return "4x4/2" if self.route == "transposed" else "x".join(map(str, self.kernel))

    @property
    def label(self) -> str:
        k = "x".join(map(str, (4, 4) if self.route == "transposed" else self.kernel))
        return f"{self.kind} {'x'.join(map(str, self.input))} -> {self.cout} k{k}"


def _kind(name: str, module: torch.nn.Module) -> str:
    """The role of a decoder conv, from diffusers' module names (facts of the architectures)."""
    if name == "conv_in":
        return "conv_in"
    if name == "conv_out":
        return "head"
    if "upsampler" in name and (name.endswith(".conv") or name.endswith("resample.1")):
        return "upsample"
    if name.endswith("time_conv"):
        return "time 3x1x1"
    kernel = tuple(module.kernel_size)
    if all(k == 1 for k in kernel):
        return "1x1"
    return ("causal " if len(kernel) == 3 else "") + "x".join(map(str, kernel))


def _record(name: str, module: torch.nn.Module, x: torch.Tensor, cached: bool) -> ConvShape:
    kind = _kind(name, module)
    kernel = tuple(module.kernel_size)
    cout = module.out_channels
    if kind == "upsample":  # hooked on the upsampled input; the pack convolves the low-res one
        n, c, h, w = x.shape
        return ConvShape(kind, "transposed", (n, c, h // 2, w // 2), cout, (3, 3), (1, 1))
    if len(kernel) == 2:
        route = "conv2d-nchw" if kind == "conv_in" and x.shape[1] % 8 else "conv2d"
        return ConvShape(kind, route, tuple(x.shape), cout, kernel, tuple(k // 2 for k in kernel))
    kt, kh, kw = kernel
    n, c, t, h, w = x.shape
    single = kt > 1 and not cached and t == 1
    if single:
        kt, frames = 1, 1  # no cache, one frame: only the last temporal tap meets real data
    else:
        frames = t + kt - 1
    kernel = (kt, kh, kw)
    taps = kernel == (3, 3, 3) or (kt == 1 and kernel != (1, 1, 1) and kernel[1:] == (3, 3))
    # Wider single frames run their last tap as conv2d where the fused path routes them so.
    wide_single = single and single_tap_2d_shape(module, tuple(x.shape))
    route = "taps" if taps and n == 1 and (c <= NARROW_TAPS or wide_single) else "conv3d"
    if (not single and wan_settings.stacked_taps
            and stacked_taps_shape(module, (n, c, t, h, w), kt - 1 if cached else 0)):
        route = "stacked"
    return ConvShape(kind, route, (n, c, frames, h, w), cout, kernel, (0, kh // 2, kw // 2))


def _decoder_on_meta(arch: str) -> torch.nn.Module:
    import diffusers

    from .models import _diffusers_config, split_arch

    name, tiny = split_arch(arch)
    class_name, config = _diffusers_config(name, tiny)
    with torch.device("meta"):
        return getattr(diffusers, class_name)(**config).to(torch.bfloat16).eval()


class _ConvCalls(torch.overrides.TorchFunctionMode):
    """Notes each 2-D/3-D conv call as (input shape, weight shape, padding, transposed)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        transposed = func in _TRANSPOSED_CONVS
        if func in _CONVS or transposed:
            x, weight = args[0], args[1]
            padding = kwargs.get("padding", args[4] if len(args) > 4 else 0)
            spatial = weight.dim() - 2
            if isinstance(padding, int):
                padding = (padding,) * spatial
            elif isinstance(padding, str):  # "same" / "valid" (stride 1 here)
                padding = tuple(k // 2 for k in weight.shape[2:]) if padding == "same" else (0,) * spatial
            self.calls.append((tuple(x.shape), tuple(weight.shape), tuple(padding), transposed))
        return func(*args, **kwargs)


_CONVS = (torch.conv2d, torch.conv3d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)
_TRANSPOSED_CONVS = (torch.conv_transpose2d, torch.nn.functional.conv_transpose2d)


@contextlib.contextmanager
def recording_convs() -> Iterator[list[ConvShape]]:
    """Inside: every conv call is noted; on exit the list holds them as ``ConvShape``s, in call
    order. Kinds come from the order and the shapes alone (no module names): a call with the
    first call's weight shape is ``conv_in``, with the last call's ``head`` (a chunked decoder
    runs its head once per chunk); a 1x1(x1) kernel ``1x1``; a conv that widens its input
    before a depth-to-space ``upsample``; a transposed one is a folded ``upsample``."""
    mode, shapes = _ConvCalls(), []
    with mode:
        yield shapes
    first, last = (mode.calls[0][1], mode.calls[-1][1]) if mode.calls else (None, None)
    for x, w, padding, transposed in mode.calls:
        cout, kernel = w[1 if transposed else 0], w[2:]
        if transposed:
            # The folded upsample (``upsample_conv_fold``): its 3x3 conv's FLOPs, per ConvShape.
            shapes.append(ConvShape("upsample", "transposed", x, cout, (3, 3), (1, 1)))
            continue
        kind = ("conv_in" if w == first else "head" if w == last else
                "1x1" if all(k == 1 for k in kernel) else "upsample" if cout > x[1] else
                ("causal " if len(kernel) == 3 else "") + "x".join(map(str, kernel)))
        route = "conv3d" if len(kernel) == 3 else "conv2d"
        shapes.append(ConvShape(kind, route, x, cout, tuple(kernel), padding))


def _recorded_shapes(case: Case, device: torch.device | None = None) -> Counter:
    """One fused (``high``) decode of ``case`` on ComfyUI's model of its architecture, through
    the node, with every conv call recorded. Needs ComfyUI imported (``bench.comfyui``)."""
    from ..nodes.fast_vae_decode import FastVAEDecode
    from .models import comfy_vae, seeded_latent

    vae = comfy_vae(case.arch, seed=0, device=device)
    z = seeded_latent(case.latent_shape, 1)
    with torch.inference_mode():
        torch.manual_seed(0)
        FastVAEDecode.execute({"samples": z}, vae, "high")  # kernels compiled, caches built
        with recording_convs() as shapes:
            torch.manual_seed(0)
            out = FastVAEDecode.execute({"samples": z}, vae, "high")
    text = out.ui["text"][0]
    if "stock calls" in text or not text.startswith("high:"):
        raise RuntimeError(f"{case.name}: the fused path did not run throughout ({text}); its "
                           "convs would be stock ones")
    return Counter(shapes)


def recorded(case: Case) -> bool:
    """Whether ``case``'s convs are recorded from a fused decode on ComfyUI's model."""
    from .models import split_arch

    return split_arch(case.arch)[0] in RECORDED_ARCHS


def collect_conv_shapes(cases: Iterable[Case], comfyui: bool = False,
                        device: torch.device | None = None) -> dict[str, Counter]:
    """Per case name: how many times each ``ConvShape`` runs in one decode of its latent.
    ``comfyui``: ComfyUI is imported, so ``RECORDED_ARCHS`` cases can be recorded."""
    found: dict[str, Counter] = {}
    for case in cases:
        if recorded(case):
            if not comfyui:
                raise ValueError(f"{case.name}: its convs are recorded from ComfyUI's own model "
                                 "(give --comfyui PATH)")
            found[case.name] = _recorded_shapes(case, device)
            continue
        model = _decoder_on_meta(case.arch)
        counts: Counter = Counter()
        handles = []
        for name, module in model.decoder.named_modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                def hook(mod, args, kwargs, out, name=name, counts=counts):
                    cache = args[1] if len(args) > 1 else kwargs.get("cache_x")
                    counts[_record(name, mod, args[0], cache is not None)] += 1
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
        z = torch.empty(case.latent_shape, device="meta", dtype=torch.bfloat16)
        with torch.no_grad():
            model.decode(z)
        for h in handles:
            h.remove()
        found[case.name] = counts
    return found


def distinct_shapes(per_case: dict[str, Counter]) -> list[tuple[ConvShape, dict[str, int]]]:
    """Each shape once, with its calls per case, in order of first appearance."""
    calls: dict[ConvShape, dict[str, int]] = {}
    for case, counts in per_case.items():
        for shape, n in counts.items():
            calls.setdefault(shape, {})[case] = n
    return list(calls.items())


# --- results -------------------------------------------------------------------------------


@dataclass
class ConvResult:
    shape: ConvShape
    calls: dict[str, int]
    cudnn_ms: float | None = None
    triton_ms: float | None = None  # the best of the tilings tried
    triton_config: str | None = None
    triton_ms_by_config: dict[str, float] = field(default_factory=dict)
    triton_max_error: float | None = None  # |triton - cuDNN + bias| / max|ref|, as a check
    note: str | None = None
    cudnn_graph: dict = field(default_factory=dict)  # ``convs --cudnn-graph`` (bench.cudnn_graph)
    gemm_ms: float | None = None  # ``convs --gemm-bound``: the GEMM of its dims (bench.gemm_bound)
    gemm_note: str | None = None  # why that GEMM was not timed

    @property
    def gflop(self) -> float:
        return self.shape.flops / 1e9

    @staticmethod
    def tflops(flops: int, ms: float | None) -> float | None:
        return None if not ms else flops / ms / 1e9

    @property
    def speedup(self) -> float | None:
        if not self.cudnn_ms or not self.triton_ms:
            return None
        return self.cudnn_ms / self.triton_ms


def to_json(results: list[ConvResult], env: dict) -> dict:
    rows = []
    for r in results:
        row = asdict(r)
        row["shape"] = {**asdict(r.shape), "output": list(r.shape.output), "label": r.shape.label}
        row.update(gflop=r.gflop, cudnn_tflops=r.tflops(r.shape.flops, r.cudnn_ms),
                   triton_tflops=r.tflops(r.shape.flops, r.triton_ms), speedup=r.speedup)
        rows.append(row)
    return {"schema": SCHEMA, "env": env, "convs": rows}


def from_json(data: dict) -> tuple[dict, list[ConvResult]]:
    if data.get("schema") != SCHEMA:
        raise ValueError(f"not a per-conv benchmark file (schema {data.get('schema')!r})")
    results = []
    for row in data["convs"]:
        s = row["shape"]
        shape = ConvShape(s["kind"], s["route"], tuple(s["input"]), s["cout"], tuple(s["kernel"]),
                          tuple(s["padding"]))
        results.append(ConvResult(shape, row["calls"], row.get("cudnn_ms"), row.get("triton_ms"),
                                  row.get("triton_config"), row.get("triton_ms_by_config") or {},
                                  row.get("triton_max_error"), row.get("note"),
                                  row.get("cudnn_graph") or {}, row.get("gemm_ms"),
                                  row.get("gemm_note")))
    return data.get("env", {}), results


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def convs_markdown(results: list[ConvResult]) -> str:
    """The per-conv table, then per case the conv time of one decode on either path."""
    cases = list(dict.fromkeys(c for r in results for c in r.calls))
    out = ["| kind | input | Cout | kernel | cuDNN route | calls (" + ", ".join(cases) + ") "
           "| GFLOP | cuDNN ms | cuDNN TFLOP/s | pack ms | pack TFLOP/s | pack/cuDNN "
           "| pack's best (Triton tiling or padded_grid_conv) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        s = r.shape
        kernel = s.kernel_text
        calls = ", ".join(str(r.calls.get(c, 0)) for c in cases)
        out.append(
            f"| {s.kind} | {'x'.join(map(str, s.input))} | {s.cout} | {kernel} | {s.route} "
            f"| {calls} | {r.gflop:.1f} | {_fmt(r.cudnn_ms)} "
            f"| {_fmt(r.tflops(s.flops, r.cudnn_ms), 0)} | {_fmt(r.triton_ms)} "
            f"| {_fmt(r.tflops(s.flops, r.triton_ms), 0)} "
            f"| {'—' if r.speedup is None else f'{r.speedup:.2f}x'} "
            f"| {r.triton_config or r.note or '—'} |")
    out += ["", "| case | convs | GFLOP | cuDNN ms | cuDNN TFLOP/s | best of both ms "
            "| best of both TFLOP/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in cases:
        rows = [r for r in results if r.calls.get(case)]
        flops = sum(r.shape.flops * r.calls[case] for r in rows)
        timed = [r for r in rows if r.cudnn_ms is not None]
        cudnn = sum(r.cudnn_ms * r.calls[case] for r in timed) if timed else None
        best = (sum(min(r.cudnn_ms, r.triton_ms or math.inf) * r.calls[case] for r in timed)
                if timed else None)
        out.append(f"| {case} | {sum(r.calls[case] for r in rows)} | {flops / 1e9:.0f} "
                   f"| {_fmt(cudnn, 2)} | {_fmt(ConvResult.tflops(flops, cudnn), 0)} "
                   f"| {_fmt(best, 2)} | {_fmt(ConvResult.tflops(flops, best), 0)} |")
    return "\n".join(out) + "\n"


# --- timing (CUDA) -------------------------------------------------------------------------


def _inputs(shape: ConvShape, device, dtype, seed: int = 0):
    """Input (in the route's layout), stock weight and bias of ``shape`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn((shape.cout, shape.input[1], *shape.kernel), generator=g)
    weight = (weight / math.sqrt(weight[0].numel())).to(device=device, dtype=dtype)
    bias = (torch.randn(shape.cout, generator=g) * 0.01).to(device=device, dtype=dtype)
    x = torch.randn(shape.input, device=device, dtype=dtype)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return x.contiguous(memory_format=fmt), weight, bias


def cudnn_call(shape: ConvShape, x: torch.Tensor, weight: torch.Tensor):
    """A no-argument function running ``shape`` as the pack runs it on cuDNN today."""
    import torch.nn.functional as F

    from ..kernels.upsample_conv_fold import fold_upsample_conv_weight

    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if shape.route == "transposed":
        w = fold_upsample_conv_weight(weight).contiguous(memory_format=fmt)
        return lambda: F.conv_transpose2d(x, w, None, stride=2, padding=1)
    if shape.route == "conv2d-nchw":
        xc, w = x.contiguous(), weight.contiguous()
        return lambda: F.conv2d(xc, w, None, padding=shape.padding)
    if shape.route == "conv2d":
        w = weight.contiguous(memory_format=fmt)
        return lambda: F.conv2d(x, w, None, padding=shape.padding)
    if shape.route == "stacked":
        from ..kernels.stacked_taps import fill_stacked_, new_stacked_input, stacked_taps_weight

        n, c, t, h, w = x.shape
        buffer = fill_stacked_(new_stacked_input(t - 2, c, h, w, x.dtype, x.device), x, 0)
        ws = stacked_taps_weight(weight)
        return lambda: F.conv2d(buffer, ws, None, padding=shape.padding[1:])
    if shape.route == "taps":
        frames = x[0].permute(1, 0, 2, 3)  # (T, C, H, W) channels-last view
        kt = shape.kernel[0]
        out_t = frames.shape[0] - kt + 1
        taps = [weight[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(kt)]
        pad = shape.padding[1:]
        return lambda: [F.conv2d(frames[k:k + out_t], taps[k], None, padding=pad)
                        for k in range(kt)]
    w = weight.contiguous(memory_format=fmt)
    return lambda: F.conv3d(x, w, None, padding=shape.padding)


def triton_supports(shape: ConvShape) -> bool:
    return shape.route != "transposed"


def narrow_supported(shape: ConvShape) -> bool:
    """``narrow_conv`` applies: spatial taps to share, few outputs (products within
    ``MAX_COLUMNS``)."""
    from ..kernels.narrow_conv import MAX_COLUMNS

    taps = shape.kernel[-2] * shape.kernel[-1]
    return (triton_supports(shape) and taps > 1 and shape.cout <= 16
            and taps * shape.cout <= MAX_COLUMNS)


@dataclass(frozen=True)
class Variant:
    """One of the pack's ways to run a shape: ``op`` (``implicit_gemm_conv``, ``narrow_conv``,
    ``winograd_conv`` or, where the optional CUTLASS DSL runs, ``padded_grid_conv``) at a
    tiling (for ``narrow_conv``, its tap-products GEMM's; for ``winograd_conv``, its two
    transforms')."""

    op: str
    config: Any

    def __str__(self) -> str:
        return f"{self.op} {self.config or 'default'}"


def winograd_supported(shape: ConvShape) -> bool:
    """``winograd_conv`` computes this shape: a channels-last 2-D 3x3 conv with padding 1."""
    return (shape.route == "conv2d" and tuple(shape.kernel) == (3, 3)
            and tuple(shape.padding) == (1, 1))


def padded_grid_key(shape: ConvShape) -> tuple[int, int, int] | None:
    """``padded_grid_conv``'s (channels in, out, temporal taps) for this shape, or None where it
    does not compute it: a batch-1 3x3x3 conv with padding (0, 1, 1), or a 2-D 3x3 conv with
    padding 1 (its batch's images the grid's frames, as the KL route runs them), of a measured
    tiling."""
    from ..kernels.padded_grid_conv import TILINGS

    if tuple(shape.kernel) == (3, 3, 3) and tuple(shape.padding) == (0, 1, 1) and shape.input[0] == 1:
        key = (shape.input[1], shape.cout, 3)
    elif shape.route == "conv2d" and tuple(shape.kernel) == (3, 3) and tuple(shape.padding) == (1, 1):
        key = (shape.input[1], shape.cout, 1)
    else:
        return None
    return key if key in TILINGS else None


def padded_grid_supported(shape: ConvShape) -> bool:
    """``padded_grid_conv`` computes this shape where the optional CUTLASS DSL runs on this
    machine's GPU (``padded_grid_key``)."""
    from ..kernels import padded_grid_conv as pgc

    if padded_grid_key(shape) is None:
        return False
    return torch.cuda.is_available() and pgc.dsl_unavailable_reason(torch.device("cuda")) is None


def variants(shape: ConvShape, sweep: bool) -> list[Variant]:
    """The Triton variants timed for ``shape``: each op's default tiling, the sweep's too."""
    from ..kernels import implicit_gemm_conv as igc
    from ..kernels.accepts import pow2

    if not triton_supports(shape):
        return []
    cin = shape.input[1]
    frames = len(shape.kernel) == 3 and shape.output[2] > 1  # time_inner changes something
    configs = [igc.default_config(cin, shape.cout)]
    if sweep:
        narrow = pow2(shape.cout) <= 16
        configs += [c for c in igc.SWEEP_CONFIGS if c not in configs
                    and (c.block_n == 16) == narrow and (frames or not c.time_inner)]
    out = [Variant("implicit_gemm_conv", c) for c in configs]
    if narrow_supported(shape):
        columns = max(16, pow2(shape.kernel[-2] * shape.kernel[-1] * shape.cout))
        k = shape.kernel[0] * cin if len(shape.kernel) == 3 else cin
        # narrow_conv's own default (config=None) first, as the fused path runs it
        tilings = [None]
        if sweep:
            tilings += [dataclasses.replace(c, block_n=min(c.block_n, columns))
                        for c in igc.NARROW_SWEEP_CONFIGS
                        if c.block_k <= max(16, pow2(k)) and (frames or not c.time_inner)]
        out += [Variant("narrow_conv", c) for c in dict.fromkeys(tilings)]
    if winograd_supported(shape):
        from ..kernels import winograd_conv as wc

        launches = [wc.LAUNCHES] + (list(wc.SWEEP_LAUNCHES) if sweep else [])
        out += [Variant("winograd_conv", c) for c in dict.fromkeys(launches)]
    if padded_grid_supported(shape):
        from ..kernels.padded_grid_conv import SWEEP_TILINGS, TILINGS

        key = padded_grid_key(shape)
        tilings = [TILINGS[key]] + (list(SWEEP_TILINGS.get(key, ())) if sweep else [])
        out += [Variant("padded_grid_conv", t) for t in tilings]
    return out


def chosen_variants(shape: ConvShape, sweep: bool, ops: tuple[str, ...] | None) -> list[Variant]:
    """``variants`` of the pack's ``ops`` only (all where None)."""
    return [v for v in variants(shape, sweep) if ops is None or v.op in ops]


def variant_call(variant: Variant, shape: ConvShape, x, weight, bias, packs: dict):
    """A no-argument function running ``variant`` on ``x`` (weights packed once, in ``packs``)."""
    from ..kernels.implicit_gemm_conv import implicit_gemm_conv, pack_conv_weight
    from ..kernels.narrow_conv import narrow_conv, pack_narrow_conv_weight

    if variant.op == "winograd_conv":
        from ..kernels.winograd_conv import winograd_conv, winograd_weight

        if "winograd" not in packs:
            packs["winograd"] = winograd_weight(weight)
        return functools.partial(winograd_conv, x, packs["winograd"], bias, launches=variant.config)
    if variant.op == "padded_grid_conv":
        from ..kernels import padded_grid_conv as pgc

        if "grid" not in packs:  # the grid is filled once, outside the timed call
            frames = x.dim() == 4  # a 2-D conv's batch: the grid's frames
            grid_x = x.transpose(0, 1).unsqueeze(0) if frames else x
            padded, interior = pgc.empty_padded(tuple(grid_x.shape), x.dtype, x.device)
            interior.copy_(grid_x)
            packs["grid"] = (padded, pgc.pack_padded_grid_weight(weight), bias.float())
        return functools.partial(pgc.padded_grid_conv, *packs["grid"], tiling=variant.config)
    if variant.op == "narrow_conv":
        if "narrow" not in packs:
            packs["narrow"] = pack_narrow_conv_weight(weight)
        packed = packs["narrow"]
        return functools.partial(narrow_conv, x, packed, shape.padding, bias,
                                 config=variant.config)
    if "igc" not in packs:
        packs["igc"] = pack_conv_weight(weight)
    packed = packs["igc"]
    return functools.partial(implicit_gemm_conv, x, packed, shape.padding, bias,
                             config=variant.config)


def _median_ms(fn, repeats: int, warmup: int, device) -> float:
    """Median GPU time of one call: calls queued back to back, so a conv of tens of µs is not
    reported at the host's launch time."""
    from .timing import queued_ms

    return statistics.median(queued_ms(fn, device, repeats, warmup))


def heaviest(shapes: list[tuple[ConvShape, dict[str, int]]], count: int) -> set[ConvShape]:
    """About ``count`` shapes: each case's heaviest (arithmetic per decode), an equal share."""
    cases = list(dict.fromkeys(c for _, calls in shapes for c in calls))
    share = -(-count // max(1, len(cases)))
    chosen = set()
    for case in cases:
        ranked = sorted((item for item in shapes if item[1].get(case)),
                        key=lambda item: -item[0].flops * item[1][case])
        chosen.update(shape for shape, _ in ranked[:share])
    return chosen


def time_convs(shapes: list[tuple[ConvShape, dict[str, int]]], *, repeats: int = 5,
               warmup: int = 2, sweep: int = 16, kinds: tuple[str, ...] | None = None,
               ops: tuple[str, ...] | None = None, log=print,
               device: str = "cuda") -> list[ConvResult]:
    """Times every shape (of ``kinds``, if given) on cuDNN and on the pack's ``variants`` (of
    ``ops``, if given): each op's default tiling, and for the ``sweep`` heaviest shapes and
    every head the other tilings too; all variants compile in parallel first."""
    device, dtype = torch.device(device), torch.bfloat16
    swept = heaviest(shapes, sweep)
    results, jobs = [], []
    for shape, calls in shapes:
        if kinds is not None and shape.kind not in kinds:
            continue
        result = ConvResult(shape, calls)
        results.append(result)
        chosen = chosen_variants(shape, shape in swept or shape.kind == "head", ops)
        if not chosen:
            result.note = "no Triton route yet"
        jobs.append((result, chosen))
    _compile_all(jobs, log, device)
    for result, chosen in jobs:
        shape = result.shape
        x, weight, bias = _inputs(shape, device, dtype)
        result.cudnn_ms = _median_ms(cudnn_call(shape, x, weight), repeats, warmup, device)
        packs: dict = {}
        for variant in list(chosen):
            fn = variant_call(variant, shape, x, weight, bias, packs)
            try:
                result.triton_ms_by_config[str(variant)] = _median_ms(fn, repeats, warmup, device)
            except Exception as exc:  # a variant that does not compile or run: the others count
                chosen.remove(variant)
                result.note = f"{variant}: {type(exc).__name__}: {exc}".splitlines()[0][:200]
        if chosen:
            best = min(result.triton_ms_by_config, key=result.triton_ms_by_config.get)
            result.triton_config, result.triton_ms = best, result.triton_ms_by_config[best]
            winner = next(v for v in chosen if str(v) == best)
            result.triton_max_error = _check(shape, x, weight, bias,
                                             variant_call(winner, shape, x, weight, bias, packs))
        log(f"{shape.label}: cuDNN {_fmt(result.cudnn_ms)} ms, pack {_fmt(result.triton_ms)} "
            f"ms ({result.triton_config or result.note})")
        del x, weight, bias, packs
    return results


def _check(shape, x, weight, bias, fn) -> float:
    """Largest |Triton - cuDNN with bias| relative to the largest output value."""
    import torch.nn.functional as F

    conv = F.conv2d if x.dim() == 4 else F.conv3d
    ref = conv(x, weight, bias, padding=shape.padding).float()
    return float((fn().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _compile_all(jobs, log, device) -> None:
    """Compile every Triton variant the timing will launch, in parallel (one per tiling,
    kernel geometry and the integer arguments' divisibility; serially, compiling would take
    most of the run). Launches are recorded on uninitialised tensors of the real sizes, so
    each variant is the one the timed call uses."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ..kernels.backend import compile_launch, recording_launches, variant_key

    start = time.perf_counter()
    records = {}
    for result, chosen in jobs:
        if not chosen:
            continue
        shape = result.shape
        fmt = torch.channels_last if len(shape.input) == 4 else torch.channels_last_3d
        x = torch.empty(shape.input, device=device, dtype=torch.bfloat16, memory_format=fmt)
        w = torch.empty((shape.cout, shape.input[1], *shape.kernel), device=device,
                        dtype=torch.bfloat16)
        b = torch.empty(shape.cout, device=device, dtype=torch.bfloat16)
        packs: dict = {}
        with recording_launches() as recorded:
            for variant in chosen:
                variant_call(variant, shape, x, w, b, packs)()
        for record in recorded:
            ints = tuple((a % 16 == 0, a == 1) for a in record[2] if isinstance(a, int))
            records.setdefault((variant_key(record), ints), record)
        del x, w, b, packs
    failures = []

    def compile_one(record) -> None:
        try:
            compile_launch(record)
        except Exception as exc:  # the timed call reports it again, for its own variant
            failures.append(f"{type(exc).__name__}: {exc}".splitlines()[0][:200])

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(compile_one, records.values()))
    log(f"compiled {len(records)} Triton variants in {time.perf_counter() - start:.1f} s"
        + (f"; {len(failures)} failed, first: {failures[0]}" if failures else ""))


def environment() -> dict:
    import platform

    env = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def write_json(path: str, results: list[ConvResult], env: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(results, env), f, indent=1)


def read_json(path: str) -> tuple[dict, list[ConvResult]]:
    with open(path, encoding="utf-8") as f:
        data: Any = json.load(f)
    return from_json(data)
