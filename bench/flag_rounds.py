"""Two ComfyUI flag sets (its memory modes), or two bench settings, compared on ``high``, in
alternating bench processes.

ComfyUI reads the flag that picks its memory mode (``--disable-dynamic-vram``) once, at start,
so the two sides of "high under dynamic VRAM within 5% of high without it" run in different
processes. One process per side is not enough to judge 5%: on an H200 the same code measured
SDXL 1024² ``high`` 22.6-25.4 ms across three processes of one session. Here bench processes
run in rounds, each round both sides, the side that goes first flipping every round (so a
drift over the session, clocks or host memory, falls on both); a side's time per case is the
median of its rounds' medians, shown with its spread.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

PROG = [sys.executable, "-m", "fast_vae_decode", "bench"]


@dataclass(frozen=True)
class Side:
    label: str
    flags: tuple[str, ...]  # ComfyUI flags, as --comfyui-args takes them
    bench_args: tuple[str, ...] = ()  # this side's own bench options (e.g. --host-copies single)


def sides_for(against: str, against_bench: str = "") -> tuple[Side, Side]:
    """ComfyUI's default flags and the bench's defaults against ``against`` (ComfyUI flags,
    e.g. ``--disable-dynamic-vram``) and ``against_bench`` (bench options): either may be
    empty, not both."""
    flags, bench_args = tuple(shlex.split(against)), tuple(shlex.split(against_bench))
    if not flags and not bench_args:
        raise ValueError("--against needs ComfyUI flags to compare with its defaults (or "
                         "--against-bench bench options)")
    return Side("default flags", ()), Side(" ".join(flags + bench_args), flags, bench_args)


def round_order(sides: tuple[Side, Side], rounds: int) -> list[tuple[int, Side]]:
    """(round, side) in run order: A B, B A, A B, ..."""
    order = []
    for r in range(rounds):
        pair = sides if r % 2 == 0 else sides[::-1]
        order += [(r, side) for side in pair]
    return order


def bench_command(tree: str, cases: str, side: Side, json_path: pathlib.Path,
                  extra: tuple[str, ...] = ()) -> list[str]:
    cmd = PROG + ["--comfyui", tree, "--cases", cases, "--precisions", "none",
                  "--triton-cache", "keep", "--paths", "high", "--json", str(json_path),
                  *extra, *side.bench_args]
    if side.flags:
        cmd.append("--comfyui-args=" + " ".join(side.flags))
    return cmd


Runner = Callable[[list[str]], int]


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd, check=False).returncode


def run_rounds(tree: str, cases: str, sides: tuple[Side, Side], rounds: int,
               out_dir: pathlib.Path, runner: Runner | None = None,
               extra: tuple[str, ...] = ()) -> dict[tuple[str, str], list[float]]:
    """Each side's ``high`` medians per case, one per round that measured it: {(side label,
    case): [ms, ...]}. A failed bench process is said and its round left out. ``runner`` runs
    one bench command (default: a subprocess)."""
    runner = runner or _run
    out_dir.mkdir(parents=True, exist_ok=True)
    times: dict[tuple[str, str], list[float]] = {}
    for r, side in round_order(sides, rounds):
        path = out_dir / f"round{r}-{'a' if side is sides[0] else 'b'}.json"
        cmd = bench_command(tree, cases, side, path, extra)
        print("+ " + shlex.join(cmd), flush=True)
        status = runner(cmd)
        if not path.exists():
            print(f"round {r} ({side.label}): no results (exit status {status})", flush=True)
            continue
        for row in json.loads(path.read_text())["results"]:
            if row.get("high_ms") is not None and row.get("precision") in (None, "as loaded"):
                times.setdefault((side.label, row["case"]), []).append(row["high_ms"])
    return times


def compare_table(times: dict[tuple[str, str], list[float]], sides: tuple[Side, Side],
                  cases: list[str]) -> str:
    """Markdown: per case each side's median of round medians (min-max, rounds) and A vs B."""
    a, b = sides
    lines = [f"| case | high ms, {a.label} | high ms, {b.label} | {a.label} vs {b.label} |",
             "| --- | --- | --- | --- |"]
    for case in cases:
        cells, medians = [], []
        for side in sides:
            ms = times.get((side.label, case), [])
            if ms:
                medians.append(statistics.median(ms))
                cells.append(f"{medians[-1]:.1f} ({min(ms):.1f}-{max(ms):.1f}, {len(ms)} rounds)")
            else:
                cells.append("—")
        diff = f"{(medians[0] / medians[1] - 1) * 100:+.1f}%" if len(medians) == 2 else "—"
        lines.append(f"| {case} | {cells[0]} | {cells[1]} | {diff} |")
    return "\n".join(lines)
