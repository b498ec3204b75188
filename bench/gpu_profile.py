"""Where one decode's GPU time goes, and how long the GPU waits on the host: a torch profiler
trace of one decode, summarised (the ``profile`` subcommand).

Busy time is the union of the kernel, memcpy and memset intervals over all streams; idle is the
span from the first GPU op to the end of the last minus busy. Each idle gap is classed by the op
that ends it: **host-late** when that op's launch call (a CUDA runtime or driver event with the
same correlation id: torch's launches are runtime calls, Triton's ``cuLaunchKernelEx`` is a
driver call) began after the gap began, so the GPU ran out of work while the host was still
issuing it; **queued** otherwise (the op was issued in time and waited on something else, such
as another stream). A decode that is host-bound in its small early stages shows host-late idle
in the first tenths of its span. Kernel time is also summed by kind, and the largest kernels
and gaps are listed.

The analysis is a pure function of the Chrome trace (``analyse_trace``), so it is tested on
synthetic traces without a GPU; only ``profile_decode`` needs one.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
CPU_CATEGORIES = frozenset({"cpu_op"})
TENTHS = 10

# Kernel kinds by name, first match wins (lower-case substrings). cuDNN's and cuBLAS's kernels
# carry their library's marks; Triton kernels keep their Python names (``_..._kernel``).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy", ("memcpy", "memset", "copy", "cat_", "catarray")),
    ("attention", ("fmha", "attention", "flash")),
    ("conv / matmul", ("xmma", "cudnn", "conv", "implicit_gemm", "gemm", "nvjet", "cutlass",
                       "sm90_", "sm80_", "fprop", "dgrad")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    if name.startswith("_") and name.endswith("_kernel"):
        return "triton"
    return "elementwise / other"


@dataclass
class Gap:
    start_us: float
    length_us: float
    late: bool  # host-late (see the module's note); False: queued
    before: str  # the GPU op that ended the gap


@dataclass
class TraceSummary:
    span_ms: float
    busy_ms: float
    host_late_ms: float
    queued_ms: float
    gap_count: int
    idle_by_tenth_ms: list[float]
    kinds: dict[str, tuple[float, int]]  # kind -> (ms, ops)
    top: list[tuple[str, float, int]]  # (kernel, ms, launches), largest first
    largest_gaps: list[Gap] = field(default_factory=list)
    # Host calls by name, (name, calls, ms, calls early, ms early), most time first: CUDA
    # runtime/driver calls (a cudaMalloc or a synchronize shows here) and torch's CPU ops
    # (inclusive: a conv2d's ms holds its cudnn_convolution's). "Early": begun before the first
    # tenth of the GPU span ended, where a decode's host-late idle sits.
    runtime_calls: list[tuple[str, int, float, int, float]] = field(default_factory=list)
    cpu_ops: list[tuple[str, int, float, int, float]] = field(default_factory=list)

    @property
    def idle_ms(self) -> float:
        return self.span_ms - self.busy_ms


def analyse_trace(trace: dict, top: int = 12, gaps: int = 8) -> TraceSummary:
    """Summarise a Chrome trace (``torch.profiler``'s ``export_chrome_trace``) of GPU work."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                 key=lambda e: e["ts"])
    if not ops:
        raise ValueError("the trace holds no GPU kernels, copies or sets")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    first, last = ops[0]["ts"], max(e["ts"] + e["dur"] for e in ops)
    span = max(last - first, 1e-9)
    busy, covered_to = 0.0, first
    found: list[Gap] = []
    by_time: Counter = Counter()
    by_kind: Counter = Counter()
    kind_ops: Counter = Counter()
    per_kernel: Counter = Counter()
    per_kernel_n: Counter = Counter()
    for e in ops:
        start, end = e["ts"], e["ts"] + e["dur"]
        if start > covered_to:
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] > covered_to
            found.append(Gap(covered_to, start - covered_to, late, e.get("name", "?")))
        busy += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
        name = e.get("name", "?")
        kind = kind_of(name)
        by_kind[kind] += e["dur"]
        kind_ops[kind] += 1
        per_kernel[name] += e["dur"]
        per_kernel_n[name] += 1
    tenths = [0.0] * TENTHS
    for g in found:
        by_time[min(TENTHS - 1, int((g.start_us - first) / span * TENTHS))] += g.length_us
    for i, v in by_time.items():
        tenths[i] = v / 1e3
    late = sum(g.length_us for g in found if g.late)
    queued = sum(g.length_us for g in found if not g.late)
    early_end = first + span / TENTHS
    host = {cat: _host_calls((e for e in events if e.get("ph") == "X" and e.get("cat") in cats),
                             early_end, top)
            for cat, cats in (("runtime", LAUNCH_CATEGORIES), ("cpu", CPU_CATEGORIES))}
    return TraceSummary(
        span_ms=span / 1e3, busy_ms=busy / 1e3, host_late_ms=late / 1e3, queued_ms=queued / 1e3,
        gap_count=len(found), idle_by_tenth_ms=tenths,
        kinds={k: (v / 1e3, kind_ops[k]) for k, v in by_kind.most_common()},
        top=[(n, v / 1e3, per_kernel_n[n]) for n, v in per_kernel.most_common(top)],
        largest_gaps=sorted(found, key=lambda g: -g.length_us)[:gaps],
        runtime_calls=host["runtime"], cpu_ops=host["cpu"])


def _host_calls(events, early_end: float, top: int) -> list[tuple[str, int, float, int, float]]:
    calls: Counter = Counter()
    us: Counter = Counter()
    early_calls: Counter = Counter()
    early_us: Counter = Counter()
    for e in events:
        name = e.get("name", "?")
        calls[name] += 1
        us[name] += e.get("dur", 0)
        if e["ts"] < early_end:
            early_calls[name] += 1
            early_us[name] += e.get("dur", 0)
    return [(n, calls[n], v / 1e3, early_calls[n], early_us[n] / 1e3)
            for n, v in us.most_common(top)]


# A profiled decode this much slower than the unprofiled median gets the note below.
SLOWED_HOST = 1.1


def _slowed_host_note(wall_ms: list[float], profiled_wall_ms: float) -> list[str]:
    """A caveat where the profiler slowed the decode: it records every op on the host, so where
    host and GPU are close in speed (Wan's 0.33 pieces) it makes host-late idle that the
    unprofiled decode does not have (docs/benchmark/7c40816: 164 ms profiled, spread over the
    decode, against ~17 ms in the first decoder call unprofiled)."""
    if not wall_ms:
        return []
    median = statistics.median(wall_ms)
    if median <= 0 or profiled_wall_ms <= SLOWED_HOST * median:
        return []
    return [f"The profiled decode took {profiled_wall_ms / median:.2f}x the unprofiled median: "
            "the profiler slowed the host, so host-late idle is overstated here; `--timeline` "
            "records where an unprofiled decode's GPU waits.", ""]


def summary_markdown(case: str, wall_ms: list[float], profiled_wall_ms: float,
                     s: TraceSummary) -> str:
    """The summary of one case as Markdown: totals, idle over time, kinds, kernels, gaps."""
    walls = ", ".join(f"{w:.1f}" for w in wall_ms)
    lines = [
        f"### {case}",
        "",
        f"unprofiled wall ms: {walls}; profiled decode {profiled_wall_ms:.1f} ms",
        "",
        "| GPU span ms | busy ms | idle ms | host-late ms | queued ms | gaps |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {s.span_ms:.1f} | {s.busy_ms:.1f} | {s.idle_ms:.1f} | {s.host_late_ms:.1f} | "
        f"{s.queued_ms:.1f} | {s.gap_count} |",
        "",
        "idle by tenth of the span, ms: " + " ".join(f"{v:.1f}" for v in s.idle_by_tenth_ms),
        "",
        *_slowed_host_note(wall_ms, profiled_wall_ms),
        "| kind | ms | ops |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {k} | {ms:.2f} | {n} |" for k, (ms, n) in s.kinds.items()]
    lines += ["", "| kernel | ms | launches |", "| --- | --- | --- |"]
    lines += [f"| `{name[:90]}` | {ms:.2f} | {n} |" for name, ms, n in s.top]
    lines += ["", "| largest gaps, ms | class | before |", "| --- | --- | --- |"]
    lines += [f"| {g.length_us / 1e3:.3f} | {'host-late' if g.late else 'queued'} | "
              f"`{g.before[:70]}` |" for g in s.largest_gaps]
    for title, rows in (("host CUDA calls", s.runtime_calls), ("host CPU ops (inclusive)", s.cpu_ops)):
        lines += ["", f"| {title} | calls | ms | calls in first tenth | ms in first tenth |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{name[:70]}` | {n} | {ms:.2f} | {n_early} | {ms_early:.2f} |"
                  for name, n, ms, n_early, ms_early in rows]
    return "\n".join(lines)


def profile_decode(decode: Callable[[], Any], device: torch.device) -> tuple[float, dict, Any]:
    """(wall ms, Chrome trace, result) of one ``decode()`` under torch's profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = decode()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) * 1e3
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return wall, json.load(f), result
    finally:
        os.unlink(path)
