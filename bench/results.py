"""Bench results: one row per case (and per decode precision), as JSON and as a Markdown table.

The JSON keeps every timing, so a later report (Markdown + plots) can be made from it alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "fast_vae_decode.bench/1"


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


def _ms(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f" ({value:.2f}x)"


def _db(r: CaseResult) -> str:
    if r.high_identical_to_lossless:
        return "identical"
    return "—" if r.psnr_high_vs_lossless_db is None else f"{r.psnr_high_vs_lossless_db:.1f}"


def _fp32(r: CaseResult) -> str:
    if r.psnr_high_vs_fp32_db is None:
        return "—"
    stock = "—" if r.psnr_stock_vs_fp32_db is None else f"{r.psnr_stock_vs_fp32_db:.1f}"
    return f"{stock} / {r.psnr_high_vs_fp32_db:.1f}"


def _yes(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**NO**")


def _mib(r: CaseResult) -> str:
    values = [r.peak_extra_mib.get(k) for k in ("stock", "lossless", "high")]
    if all(v is None for v in values):
        return "—"
    return " / ".join("—" if v is None else f"{v:.0f}" for v in values)


HEADER = ("| case | back end | dtype | stock ms | lossless ms | high ms | PSNR high vs lossless dB "
          "| PSNR vs fp32 stock / high dB | lossless bit-exact | peak extra MiB stock / lossless / high "
          "| first high +ms | path |")


def markdown_table(results: list[CaseResult]) -> str:
    lines = [HEADER, "|" + " --- |" * HEADER.count(" | ") + " --- |"]
    for r in results:
        if r.skipped or r.error:
            why = f"skipped: {r.skipped}" if r.skipped else f"error: {r.error}"
            lines.append(f"| {r.label} | {r.backend or '—'} | | | | | | | | | | {why} |")
            continue
        exact = _yes(r.lossless_bit_exact)
        if r.stock_bit_exact_after_install is False:
            exact += " (stock changed after install!)"
        base = _x(r.high_speedup_vs_base_stock).replace(")", " vs base stock)")
        lines.append(
            f"| {r.label} | {r.backend} | {r.dtype} | {_ms(r.stock_ms)} "
            f"| {_ms(r.lossless_ms)}{_x(r.lossless_speedup)} | {_ms(r.high_ms)}{_x(r.high_speedup)}"
            f"{base} | {_db(r)}{'' if r.high_finite in (None, True) else ' **NaN/Inf**'} "
            f"| {_fp32(r)} | {exact} | {_mib(r)} | {_ms(r.first_high_overhead_ms)} | {r.high_path or ''} |")
    return "\n".join(lines)
