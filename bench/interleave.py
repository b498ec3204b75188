"""The pack's own switches compared on ``high`` in one process, variant by variant per decode.

Between processes the same code measured SDXL 1024² ``high`` anywhere from 24.7 to 41.7 ms on
the H200 host (each process gets its own host speed: where its threads land, what wakes
beside them), so two bench processes per setting cannot resolve a few percent (``modes``
needs rounds for that). A switch that can be flipped at run time (the KL settings, the host
copies) needs no second process: here every variant decodes once per round, in a shuffled
order, so whatever the process's host does falls on all of them alike, and a 2-3% difference
stands out of a 15-round median. Every variant starts from the switches as the process had
them (the pack's defaults, or what the command line set) and applies only its own options.

With ``--stock`` the stock decode (ComfyUI's own ``VAEDecode``) takes its turn in every round as well (the
``stock`` row), so a speed-up is read against stock decoded in the same minutes, not in a block
before ``high`` as ``bench`` does: between two bench runs on one machine type stock moved by up
to a quarter (docs/benchmark/aceb145) while ``high`` stayed within a few percent. Stock decodes a
twin of the model (same weights, same latent) that the pack never installs in: an installed
model's closed gate runs the pack's bit-exact cheaper paths (a Wan 2.1 x33 "stock" decode of the
installed model read 604 ms against 692 before the install, H200, ComfyUI 0.8).

Under ComfyUI's dynamic VRAM (0.33 and newer, default flags) the twin is a second model that
each turn loads, and ``high``'s rounds then read about twice their single-model time on the
image cases (SDXL 1024² 47-48 ms against 22-25 in ``bench``, H200 and H100): what is timed is
a workflow alternating two VAEs, not one VAE decoded again and again. ``stock_note`` says so
under the table; there ``bench`` (stock, then the pack on the same model) is the measure.
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


# The row of ComfyUI's own ``VAEDecode`` under ``--stock``; no variant may take its name.
STOCK = "stock"


def parse_variants(texts: list[str], stock: bool = False) -> list[Variant]:
    """The variants to compare, the first the baseline. With ``stock`` one is enough (stock is
    the comparison) and none means ``high`` as the process has its switches."""
    if stock and not texts:
        texts = ["high="]
    variants = [parse_variant(t) for t in texts]
    names = [v.name for v in variants]
    if len(variants) < (1 if stock else 2):
        raise ValueError("give at least two --variant (the first is the baseline), "
                         "or one with --stock")
    if len(set(names)) != len(names):
        raise ValueError(f"variant names repeat: {', '.join(names)}")
    if STOCK in names:
        raise ValueError(f"{STOCK!r} is the name of --stock's row; name the variant otherwise")
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
                    decodes: dict[str, Callable[[], Any]] | None = None) -> Interleaved:
    """Each variant's ``timed(decode)`` milliseconds, one per round, after ``warmup`` untimed
    decodes each (the first decode under a setting may build or compile what it needs), and
    the paths its timed decodes took (``path_of`` of each result): a module that fell back to
    its stock path under one variant stays there for the session, so every later variant
    would be timed on it too, and the table must say so. ``decodes`` gives a variant its own
    decode instead of ``decode`` (the stock row's ``VAEDecode``)."""
    names = list(applies)
    decode_of = {name: (decodes or {}).get(name, decode) for name in names}
    for name in names:
        applies[name]()
        for _ in range(warmup):
            decode_of[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    paths: dict[str, list[str]] = {name: [] for name in names}
    for name in schedule(names, rounds, seed):
        applies[name]()
        ms, result = timed(decode_of[name])
        times[name].append(ms)
        path = path_of(result)
        if path is not None and path not in paths[name]:
            paths[name].append(path)
    return Interleaved(times, paths)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(median, q1, q3), the quartiles as the nearest lower rank (few rounds: no interpolation)."""
    t = sorted(values)
    return statistics.median(t), t[len(t) // 4], t[(3 * len(t)) // 4]


def _spread(times: list[float]) -> str:
    median, q1, q3 = _quartiles(times)
    return f"{median:.1f} ({q1:.1f}-{q3:.1f}, {len(times)})"


def round_speedups(stock: list[float], variant: list[float]) -> list[float]:
    """Stock's time over the variant's, round by round: each round decodes every row once, so
    the i-th times of two rows were taken in the same round."""
    return [s / v for s, v in zip(stock, variant, strict=True)]


def stock_note(memory_mode: str | None) -> str | None:
    """The caveat printed under a ``--stock`` table from a tree whose models load through
    dynamic VRAM (``bench.comfyui.memory_mode``); None where the rounds time one model alone."""
    if memory_mode != "dynamic VRAM":
        return None
    return ("Note: ComfyUI loads models with dynamic VRAM here, so the stock twin and the fast "
            "model take turns being loaded: high's rounds time a workflow alternating two VAEs "
            "(on 0.33 about twice high's single-model time on the image cases). For one VAE "
            "decoded again and again, read bench's table (stock, then the pack, on one model).")


def summary_table(results: dict[str, Interleaved], variants: list[Variant],
                  stock_before: dict[str, list[float]] | None = None) -> str:
    """Markdown: per case and variant the median (quartiles, rounds), against the first, and
    the path its decodes reported; with a stock row, each variant's speed-up over it (the
    median of the per-round ratios, and their quartiles), and ``stock_before``'s decodes (the
    high subject's stock before its install: the twin's stock in the rounds should read alike)."""
    base = variants[0].name
    with_stock = any(STOCK in r.times for r in results.values())
    rows = ["| case | variant | options | ms, median (q1-q3, rounds) | vs " + base
            + (" | stock ÷ variant, median of rounds (q1-q3)" if with_stock else "")
            + " | path |",
            "| --- | --- | --- | --- | --- |" + (" --- |" if with_stock else "") + " --- |"]
    for case, result in results.items():
        by_variant = result.times
        reference = statistics.median(by_variant[base])
        for v in variants:
            change = ("—" if v.name == base else
                      f"{100 * (statistics.median(by_variant[v.name]) / reference - 1):+.1f}%")
            speedup = ""
            if STOCK in by_variant:
                median, q1, q3 = _quartiles(round_speedups(by_variant[STOCK], by_variant[v.name]))
                speedup = f" {median:.2f}x ({q1:.2f}-{q3:.2f}) |"
            path = "; ".join(result.paths.get(v.name, [])) or "—"
            rows.append(f"| {case} | {v.name} | {' '.join(v.options) or '(as set)'} | "
                        f"{_spread(by_variant[v.name])} | {change} |{speedup} {path} |")
        if STOCK in by_variant:
            rows.append(f"| {case} | {STOCK} | stock decode | "
                        f"{_spread(by_variant[STOCK])} | — | — | stock |")
        if (stock_before or {}).get(case):
            rows.append(f"| {case} | {STOCK} before install | stock decode, timed before the "
                        f"rounds | {_spread(stock_before[case])} | — |"
                        + (" — |" if with_stock else "") + " stock |")
    return "\n".join(rows)
