"""The attention benchmark: the KL mid-block's single-head attention at the bench cases' sizes,
timed on each way the fused path can run it (``fastpath.families.kl.settings.attention``).

Per case the call is ``softmax(q k^T) v`` over (batch, latent H*W, 512) bf16 tokens, as the
folded ``AttnBlock`` hands it over (scale in ``q``, keys the normed tokens); the inputs are
seeded random tokens with scores of a few units. Paths: ``chunked`` (cuBLAS scores, torch's
softmax, cuBLAS values), ``sdpa`` (torch SDPA: stock's kernel at d = 512) and ``exp_scores``
(``kernels.exp_scores`` under each tile config asked for). Each path's error is taken against
an fp32 attention on the first query rows, and its peak memory beyond the inputs is noted.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from ..kernels import exp_scores as exp_scores_module
from ..kernels.exp_scores import EXP_SCORES_CONFIG, POINTER_CONFIG, ExpScoresConfig
from ..kernels.vae_attention import attention_chunked, attention_exp_scores, attention_sdpa
from .cases import Case
from .timing import measure

SCHEMA = "fast_vae_decode.attention/1"
CHANNELS = 512  # the KL VAEs' mid-block width
ATTENTION_CASES = ("sdxl-2048", "sdxl-1024", "sd15-768x512-b4")
# Tile configs to try (block_m x block_n x block_k, warps, stages, "t": the persistent TMA
# kernel); the first is the default (the TMA kernel's), the second the pointer kernel's.
CANDIDATES = (EXP_SCORES_CONFIG, POINTER_CONFIG, ExpScoresConfig(128, 256, 64, 8, 3),
              ExpScoresConfig(128, 128, 64, 4, 4), ExpScoresConfig(256, 128, 64, 8, 3))
CHECK_ROWS = 256


def config_name(cfg: ExpScoresConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
            + ("t" if cfg.tma else ""))


def parse_config(text: str) -> ExpScoresConfig:
    """``128x128x64w8s3`` (``t`` at the end: the TMA kernel) -> ExpScoresConfig; ValueError
    with what was expected."""
    try:
        tma = text.endswith("t")
        tiles, rest = text.removesuffix("t").split("w")
        warps, stages = rest.split("s")
        m, n, k = (int(v) for v in tiles.split("x"))
        return ExpScoresConfig(m, n, k, int(warps), int(stages), tma)
    except ValueError:
        raise ValueError(f"{text!r}: expected BMxBNxBKwWARPSsSTAGES[t], e.g. 128x256x64w8s3t") from None


def tokens_of(case: Case) -> tuple[int, int]:
    """(batch, tokens) of a KL case's mid-block attention: the latent's pixels."""
    if case.video:
        raise ValueError(f"{case.name}: not a KL image case")
    batch, _, height, width = case.latent_shape
    return batch, height * width


@dataclass
class AttentionResult:
    case: str
    batch: int
    tokens: int
    path: str  # chunked | sdpa | exp_scores:<config>
    median_ms: float | None = None
    speedup_vs_chunked: float | None = None
    max_abs_error: float | None = None  # against an fp32 attention on the first rows
    peak_extra_mib: float | None = None
    tripped: bool | None = None
    error: str | None = None
    times_ms: list[float] = field(default_factory=list)


def _inputs(batch: int, tokens: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(batch, tokens, CHANNELS, device=device, generator=g).bfloat16()
    w = (torch.randn(CHANNELS, CHANNELS, device=device, generator=g) * 0.25 / CHANNELS).bfloat16()
    v = torch.randn(batch, tokens, CHANNELS, device=device, generator=g).bfloat16()
    return h @ w, h, v


def time_attention(cases: list[Case], configs: list[ExpScoresConfig], *, repeats: int = 10,
                   device="cuda", log=print) -> list[AttentionResult]:
    results: list[AttentionResult] = []
    for case in cases:
        results += _time_case(case, configs, repeats, device, log)
    return results


def _time_case(case: Case, configs, repeats: int, device, log) -> list[AttentionResult]:
    batch, tokens = tokens_of(case)
    q, k, v = _inputs(batch, tokens, device)
    rows = min(CHECK_ROWS, tokens)
    exact = torch.softmax(q[:, :rows].float() @ k.float().transpose(1, 2), -1) @ v.float()
    flag = torch.zeros((), dtype=torch.bool, device=device)
    paths = [("chunked", None, lambda: attention_chunked(q, k, v)),
             ("sdpa", None, lambda: attention_sdpa(q, k, v))]
    paths += [(f"exp_scores:{config_name(cfg)}", cfg, lambda: attention_exp_scores(q, k, v, flag))
              for cfg in configs]
    results, base = [], None
    for name, cfg, call in paths:
        row = AttentionResult(case.name, batch, tokens, name)
        previous = exp_scores_module.EXP_SCORES_CONFIG
        exp_scores_module.EXP_SCORES_CONFIG = cfg or previous
        try:
            flag.zero_()
            m = measure(call, device, repeats, warmup=2)
            row.times_ms, row.median_ms = m.times_ms, m.median_ms
            row.max_abs_error = (m.output[:, :rows].float() - exact).abs().max().item()
            if m.peak_extra_bytes is not None:
                row.peak_extra_mib = m.peak_extra_bytes / 2 ** 20
            row.tripped = bool(flag.item()) if cfg is not None else None
        except Exception as exc:  # one path's failure (a compile, memory) is its row's
            row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        finally:
            exp_scores_module.EXP_SCORES_CONFIG = previous
        if name == "chunked":
            base = row.median_ms
        if base and row.median_ms:
            row.speedup_vs_chunked = base / row.median_ms
        log(f"{case.name} {name}: "
            + (row.error or f"{row.median_ms:.3f} ms, error {row.max_abs_error:.2e}"))
        results.append(row)
    return results


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def attention_markdown(results: list[AttentionResult]) -> str:
    lines = ["| case | batch x tokens | path | ms | vs chunked | max abs error vs fp32 | "
             "peak extra MiB | tripped |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.case} | {r.batch} x {r.tokens} | {r.path} | "
                     + (f"error: {r.error} | | | | |" if r.error else
                        f"{_fmt(r.median_ms, '.3f')} | {_fmt(r.speedup_vs_chunked, '.2f')}x | "
                        f"{_fmt(r.max_abs_error, '.2e')} | {_fmt(r.peak_extra_mib, '.0f')} | "
                        f"{'—' if r.tripped is None else ('yes' if r.tripped else 'no')} |"))
    return "\n".join(lines)


def write_json(path: str, results: list[AttentionResult], env: dict) -> None:
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, "environment": env,
                   "results": [asdict(r) for r in results]}, f, indent=1)
