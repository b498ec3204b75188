"""Bench results: one row per case (and per decode precision), as JSON and as a Markdown table.

The JSON keeps every timing, so a later report (Markdown + plots) can be made from it alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "fast_vae_decode.bench/1"
PSNR_BAR_DB = 50.0  # TARGETS.md: high must stay at or above this against lossless


@dataclass
class CaseResult:
    case: str
    arch: str
    latent_shape: list[int]
    backend: str | None = None  # "comfyui" | "diffusers"
    precision: str | None = None  # decode precision variant (Wan), None for the VAE as loaded
    skipped: str | None = None  # why the case was not measured
    error: str | None = None  # what went wrong while measuring it
    device: str | None = None
    dtype: str | None = None
    output_shape: list[int] | None = None
    repeats: int = 0
    stock_ms: float | None = None
    lossless_ms: float | None = None
    high_ms: float | None = None
    lossless_speedup: float | None = None  # stock_ms / lossless_ms
    high_speedup: float | None = None  # stock_ms / high_ms
    high_speedup_vs_base_stock: float | None = None  # precision rows: vs the VAE as loaded
    psnr_high_vs_lossless_db: float | None = None  # None when identical (infinite)
    high_identical_to_lossless: bool | None = None
    # Both against an fp32 decode of the same weights: how close each path is to the "true"
    # image. On random weights bf16 rounding alone costs a few dB below 50 (see the README).
    psnr_stock_vs_fp32_db: float | None = None
    psnr_high_vs_fp32_db: float | None = None
    high_finite: bool | None = None
    lossless_bit_exact: bool | None = None  # torch.equal(lossless, stock before install)
    stock_bit_exact_after_install: bool | None = None
    peak_extra_mib: dict[str, float | None] = field(default_factory=dict)  # per path, CUDA only
    first_high_ms: float | None = None  # the first high decode: install + kernel compilation
    first_high_overhead_ms: float | None = None  # first_high_ms - high_ms
    high_path: str | None = None  # the node's UI text, e.g. "high: 38 fused modules"
    cuda_graph: str | None = None  # what the graph replay did on the last timed high decode
    # One high decode's ComfyUI progress reports (bar update + interrupt check): how many, and
    # the host time spent in them (bench/progress_cost.py). ComfyUI subjects only.
    high_progress_updates: int | None = None
    high_progress_ms: float | None = None
    high_info: dict[str, Any] = field(default_factory=dict)
    lossless_path: str | None = None
    times_ms: dict[str, list[float]] = field(default_factory=dict)
    # --crops / --crops-npz: path -> crop key (file name without extension), where it was cut
    # (frame, box [top, left, h, w]) and the files written; see bench/crops.py.
    crops: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.case if self.precision is None else f"{self.case} @{self.precision}"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str, environment: dict, results: list[CaseResult]) -> None:
    payload = {"schema": SCHEMA, "environment": environment,
               "results": [_json_safe(asdict(r)) for r in results]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def read_json(path: str) -> tuple[dict, list[CaseResult]]:
    """(environment, results) of a file ``write_json`` wrote, e.g. for a later report."""
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    if payload.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a bench result file of schema {SCHEMA}")
    return payload["environment"], [CaseResult(**row) for row in payload["results"]]


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def _flag(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**NO**")


def _psnr(r: CaseResult) -> str:
    if r.high_identical_to_lossless:
        return "identical"
    text = _num(r.psnr_high_vs_lossless_db)
    if r.psnr_high_vs_lossless_db is not None and r.psnr_high_vs_lossless_db < PSNR_BAR_DB:
        text = f"**{text}**"
    return text if r.high_finite in (None, True) else f"{text} **NaN/Inf**"


def _progress(r: CaseResult) -> str:
    if r.high_progress_updates is None:
        return "—"
    return f"{r.high_progress_updates} / {_num(r.high_progress_ms, 2)}"


def _peak(r: CaseResult) -> str:
    values = [r.peak_extra_mib.get(k) for k in ("stock", "lossless", "high")]
    if all(v is None for v in values):
        return "—"
    return " / ".join(_num(v, 0) for v in values)


COLUMNS = ("case", "precision", "back end", "dtype", "stock ms", "lossless ms", "high ms",
           "lossless vs stock", "high vs stock", "high vs base stock", "PSNR high vs lossless dB",
           "PSNR vs fp32: stock / high dB", "lossless bit-exact", "stock unchanged after install",
           "peak extra MiB stock / lossless / high", "first high ms", "first-decode overhead ms",
           "progress updates / ms per high decode", "high path")


def markdown_table(results: list[CaseResult]) -> str:
    """One row per result, as the bench prints it and the report shows it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in results:
        head = [r.case, r.precision or "as loaded", r.backend or "—"]
        if r.skipped or r.error:
            why = f"skipped: {r.skipped}" if r.skipped else f"error: {r.error}"
            lines.append("| " + " | ".join(head + [""] * (len(COLUMNS) - 4) + [why]) + " |")
            continue
        cells = head + [
            r.dtype or "—", _num(r.stock_ms), _num(r.lossless_ms), _num(r.high_ms),
            _ratio(r.lossless_speedup), _ratio(r.high_speedup),
            _ratio(r.high_speedup_vs_base_stock), _psnr(r),
            f"{_num(r.psnr_stock_vs_fp32_db)} / {_num(r.psnr_high_vs_fp32_db)}",
            _flag(r.lossless_bit_exact),
            _flag(r.stock_bit_exact_after_install), _peak(r), _num(r.first_high_ms),
            _num(r.first_high_overhead_ms), _progress(r), (r.high_path or "").replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
