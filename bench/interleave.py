"""The pack's own switches compared on ``high`` in one process, variant by variant per decode.

Between processes the same code measured SDXL 1024² ``high`` anywhere from 24.7 to 41.7 ms on
the H200 host (each process gets its own host speed: where its threads land, what wakes
beside them), so two bench processes per setting cannot resolve a few percent (``modes``
needs rounds for that). A switch that can be flipped at run time (the KL settings, the host
copies) needs no second process: here every variant decodes once per round, in a shuffled
order, so whatever the process's host does falls on all of them alike, and a 2-3% difference
stands out of a 15-round median. Every variant starts from the switches as the process had
them (the pack's defaults, or what the command line set) and applies only its own options.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import shlex
import statistics
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class Variant:
    name: str
    options: tuple[str, ...]  # the bench options it applies (--host-copies, --kl-setting)


def parse_variant(text: str) -> Variant:
    """``NAME=OPTIONS`` (``split+nib=--host-copies split --kl-setting norm_input_bias=true``);
    ValueError for a missing name or options a shell could not split."""
    name, sep, options = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"expected NAME=OPTIONS (OPTIONS may be empty); got {text!r}")
    return Variant(name, tuple(shlex.split(options)))


def parse_variants(texts: list[str]) -> list[Variant]:
    variants = [parse_variant(t) for t in texts]
    names = [v.name for v in variants]
    if len(variants) < 2:
        raise ValueError("give at least two --variant (the first is the baseline)")
    if len(set(names)) != len(names):
        raise ValueError(f"variant names repeat: {', '.join(names)}")
    return variants


def options_parser(host_copies: tuple[str, ...],
                   triton_launch: tuple[str, ...]) -> argparse.ArgumentParser:
    """What a variant may set: the run-time switches ``bench`` also takes."""
    parser = argparse.ArgumentParser(prog="--variant", add_help=False, exit_on_error=False)
    parser.add_argument("--host-copies", choices=host_copies, default=None)
    parser.add_argument("--kl-setting", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--wan-setting", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--triton-launch", choices=triton_launch, default=None)
    return parser


class Switches:
    """The run-time switches' values as they are now, to go back to before each variant."""

    def __init__(self):
        from ..fastpath.families.kl.settings import settings
        from ..fastpath.families.wan.settings import settings as wan_settings
        from ..fastpath.pixels.decode import pixel_settings
        from ..fastpath.pixels.finish import host_copy
        from ..kernels.direct_launch import launch_settings

        self.objects = (settings, wan_settings, pixel_settings, host_copy, launch_settings)
        self.saved = [dataclasses.replace(o) for o in self.objects]

    def restore(self) -> None:
        for live, saved in zip(self.objects, self.saved, strict=True):
            for f in dataclasses.fields(live):
                setattr(live, f.name, getattr(saved, f.name))


def schedule(names: list[str], rounds: int, seed: int = 0) -> list[str]:
    """Every name once per round, each round in its own seeded shuffle."""
    rng = random.Random(seed)
    order: list[str] = []
    for _ in range(rounds):
        shuffled = list(names)
        rng.shuffle(shuffled)
        order += shuffled
    return order


class Interleaved(NamedTuple):
    times: dict[str, list[float]]  # per variant, one per round (ms)
    paths: dict[str, list[str]]  # per variant, each distinct path its decodes reported


def run_interleaved(decode: Callable[[], Any], applies: dict[str, Callable[[], None]],
                    rounds: int, warmup: int, timed: Callable[[Callable[[], Any]], tuple[float, Any]],
                    seed: int = 0, path_of: Callable[[Any], str | None] = lambda result: None,
                    ) -> Interleaved:
    """Each variant's ``timed(decode)`` milliseconds, one per round, after ``warmup`` untimed
    decodes each (the first decode under a setting may build or compile what it needs), and
    the paths its timed decodes took (``path_of`` of each result): a module that fell back to
    its stock path under one variant stays there for the session, so every later variant
    would be timed on it too, and the table must say so."""
    names = list(applies)
    for name in names:
        applies[name]()
        for _ in range(warmup):
            decode()
    times: dict[str, list[float]] = {name: [] for name in names}
    paths: dict[str, list[str]] = {name: [] for name in names}
    for name in schedule(names, rounds, seed):
        applies[name]()
        ms, result = timed(decode)
        times[name].append(ms)
        path = path_of(result)
        if path is not None and path not in paths[name]:
            paths[name].append(path)
    return Interleaved(times, paths)


def summary_table(results: dict[str, Interleaved], variants: list[Variant]) -> str:
    """Markdown: per case and variant the median (quartiles, rounds), against the first, and
    the path its decodes reported."""
    base = variants[0].name
    rows = ["| case | variant | options | high ms, median (q1-q3, rounds) | vs " + base
            + " | high path |", "| --- | --- | --- | --- | --- | --- |"]
    for case, result in results.items():
        by_variant = result.times
        reference = statistics.median(by_variant[base])
        for v in variants:
            t = sorted(by_variant[v.name])
            q1, q3 = t[len(t) // 4], t[(3 * len(t)) // 4]
            median = statistics.median(t)
            change = "—" if v.name == base else f"{100 * (median / reference - 1):+.1f}%"
            path = "; ".join(result.paths.get(v.name, [])) or "—"
            rows.append(f"| {case} | {v.name} | {' '.join(v.options) or '(as set)'} | "
                        f"{median:.1f} ({q1:.1f}-{q3:.1f}, {len(t)}) | {change} | {path} |")
    return "\n".join(rows)
