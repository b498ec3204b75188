"""``python -m fast_vae_decode report``: a bench JSON (and its crops) -> README.md + PNG plots.

Everything comes from the files the bench wrote, so a report can be made on a machine other
than the one that measured. The Markdown is plain text (``report_markdown``, no plotting
library); the plots need matplotlib (the ``report`` extra).
"""
from __future__ import annotations

import math
import pathlib
import shlex

from .results import PSNR_BAR_DB, CaseResult, markdown_table, read_json

DIFF_GAIN = 20  # |high - lossless| in 8-bit levels, times this: 1 level becomes visible
MATPLOTLIB_MISSING = ("the report's plots need matplotlib: pip install matplotlib "
                      "(or the package's 'report' extra)")


def require_matplotlib():
    """matplotlib.pyplot on the non-interactive Agg back end, or RuntimeError saying what to do."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(MATPLOTLIB_MISSING) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def measured(results: list[CaseResult]) -> list[CaseResult]:
    return [r for r in results if not r.skipped and not r.error and r.stock_ms is not None]


def command_line(env: dict) -> str:
    """The bench command as it was run (ComfyUI from the environment variable when not given)."""
    argv = env.get("argv") or []
    line = "python -m fast_vae_decode " + shlex.join(argv)
    if env.get("comfyui") and not any(a.startswith("--comfyui") and "args" not in a
                                      for a in argv):
        line = f"COMFYUI_PATH={shlex.quote(str(env['comfyui']))} {line}"
    return line


ENV_KEYS = (("gpu", "GPU"), ("device", "device"), ("torch", "torch"), ("triton", "Triton"),
            ("triton_unavailable", "Triton unavailable because"), ("diffusers", "diffusers"),
            ("comfyui_version", "ComfyUI"), ("comfyui", "ComfyUI tree"),
            ("comfyui_memory_mode", "ComfyUI memory mode"), ("commit", "pack commit"),
            ("pixel_finish", "pixel output"), ("host_copies", "host-side copies"),
            ("triton_launch", "Triton launches"),
            ("python", "Python"), ("seed", "seed"), ("warmup", "warm-up decodes"),
            ("repeats", "timed decodes (None: 11 images / 3 video)"),
            ("burn_in_s", "burn-in seconds (None: 3 on CUDA)"),
            ("host_malloc", "host allocator"))


def convs_section(env: dict, results) -> list[str]:
    """The per-conv benchmark's tables (``bench.convs``) as a report section."""
    from .convs import convs_markdown

    where = ", ".join(f"{k} `{env[k]}`" for k in ("gpu", "torch", "triton", "cudnn") if env.get(k))
    return ["## Per-conv benchmark", "",
            "Every distinct convolution of the decoders, as the fused path runs it (folded "
            "upsampling, cached frames in front of causal convs, narrow 3x3x3 convs as three "
            "2-D taps): cuDNN channels-last bf16 without bias (the pack adds it in the next "
            "fused pass) against the pack's Triton convs with their bias (`implicit_gemm_conv`; "
            "`narrow_conv` where few outputs share the taps), the fastest variant tried named "
            "in the last column. "
            "Median per-call time of calls queued back to back behind a GPU sleep between two "
            "CUDA events (`bench.timing.queued_ms`; tables made before s45 timed one call per "
            "event pair, which for ops of tens of µs measured the host)"
            + (f"; {where}." if where else "."), "",
            convs_markdown(results), ""] + _graph_section(results) + _gemm_section(results)


def _graph_section(results) -> list[str]:
    """``convs --cudnn-graph``'s table, where the run made one."""
    from .cudnn_graph import graph_markdown

    if not any(r.cudnn_graph for r in results):
        return []
    return ["### cuDNN's graph API on the 2-D convs", "",
            "The conv and the pack's pass after it (its bias and the residual; with the next "
            "norm's statistics) against cuDNN graphs of the same conv: alone, with the bias + "
            "residual epilogue, with `genstats`, and with GroupNorm's apply + SiLU as its "
            "prologue (`bench/cudnn_graph.py`).", "", graph_markdown(results), ""]


def _gemm_section(results) -> list[str]:
    """``convs --gemm-bound``'s table, where the run made one."""
    from .gemm_bound import gemm_markdown

    if not any(r.gemm_ms is not None or r.gemm_note for r in results):
        return []
    return ["### Each conv's own matrix product on cuBLAS", "",
            "cuDNN's conv against a dense bf16 GEMM of the same M x N x K (`torch.mm`): the most "
            "an implicit-GEMM conv from any library reaches without fusing other work into it, "
            "where the product is compute-bound (`bench/gemm_bound.py`).", "",
            gemm_markdown(results), ""]


def report_markdown(env: dict, results: list[CaseResult], plots: dict[str, str],
                    crop_figures: dict[str, tuple[str, str]],
                    convs: tuple[dict, list] | None = None) -> str:
    """The README text. ``plots``: "time"/"psnr" -> file name; ``crop_figures``: row label ->
    (file name, caption); ``convs``: a per-conv benchmark's (env, results)."""
    out = ["# Fast VAE Decode benchmark", "",
           "Stock (ComfyUI's `VAEDecode`, or the diffusers decode without ComfyUI) against this "
           "pack's `lossless` and `high` qualities, in one process, on seeded random-weight VAEs "
           "of each architecture. Times are medians of the timed decodes (CUDA events); the "
           "first high decode (install + kernel compilation) is timed alone.", "",
           "## Environment", ""]
    for key, name in ENV_KEYS:
        value = env.get(key)
        if value not in (None, "", []):
            out.append(f"- {name}: `{value}`")
    if env.get("comfyui_args"):
        out.append(f"- ComfyUI flags: `{shlex.join(env['comfyui_args'])}`")
    out += ["", "Made with:", "", "```", command_line(env), "```", "",
            "## Results", "",
            "Ratios are stock time / path time (above 1x is faster). `high vs base stock`: a "
            "decode-precision row's high time against stock with the VAE as loaded. PSNR is high "
            f"against lossless on [0, 1] images; the bar is {PSNR_BAR_DB:.0f} dB. `PSNR vs fp32`: "
            "stock and high each against a decode by an fp32 copy of the same weights; on these "
            "random weights bf16 rounding alone keeps stock below 50 dB from fp32, so a bf16 "
            "path that computes the convolutions in another order (channels-last, folded "
            "upsampling) cannot be 50 dB from stock, and high being at least as close to fp32 "
            "as stock is the accuracy evidence. Peak extra "
            "memory is what a decode allocates on top of weights and inputs (CUDA only). "
            "First-decode overhead = first high decode - median high decode. `progress`: "
            "how many times one high decode moved ComfyUI's progress bar (and checked for "
            "Cancel), and the host time those reports took in all.", "",
            markdown_table(results), ""]
    if "time" in plots:
        out += ["## Decode time", "", f"![decode time per case]({plots['time']})", ""]
    if "psnr" in plots:
        out += ["## Quality of high", "",
                f"![PSNR of high against lossless per row]({plots['psnr']})", ""]
    if convs is not None:
        out += convs_section(*convs)
    if crop_figures:
        out += ["## Crops", ""]
        for label, (name, caption) in crop_figures.items():
            out += [f"### {label}", "", f"![{label}: lossless, high, difference]({name})", "",
                    caption, ""]
    return "\n".join(out).rstrip() + "\n"


def plot_times(plt, results: list[CaseResult], path: pathlib.Path) -> bool:
    """Grouped bars per case: stock, lossless, high, and high at each decode precision."""
    base = [r for r in measured(results) if r.precision is None]
    if not base:
        return False
    precisions = list(dict.fromkeys(r.precision for r in measured(results) if r.precision))
    series = {"stock": [r.stock_ms for r in base], "lossless": [r.lossless_ms for r in base],
              "high": [r.high_ms for r in base]}
    for p in precisions:
        by_case = {r.case: r.high_ms for r in measured(results) if r.precision == p}
        series[f"high @{p}"] = [by_case.get(r.case) for r in base]
    values = [v for vs in series.values() for v in vs if v]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(base) + 2), 4.5))
    width = 0.8 / len(series)
    for i, (name, vs) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(base))]
        ax.bar(xs, [v if v else math.nan for v in vs], width, label=name)
    ax.set_xticks(range(len(base)), [r.case for r in base], rotation=20, ha="right")
    # Cases span small images to long videos: a log axis keeps every group readable.
    if max(values) / min(values) > 30:
        ax.set_yscale("log")
    ax.set_ylabel("median decode time, ms" + (" (log)" if ax.get_yscale() == "log" else ""))
    ax.set_title("Decode time per case (lower is better)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_psnr(plt, results: list[CaseResult], path: pathlib.Path) -> bool:
    rows = measured(results)
    if not rows:
        return False
    finite = [r.psnr_high_vs_lossless_db for r in rows if r.psnr_high_vs_lossless_db is not None]
    top = max(finite + [PSNR_BAR_DB]) + 10  # where "identical" rows are drawn
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5))
    for i, r in enumerate(rows):
        if r.high_identical_to_lossless:
            ax.bar(i, top, color="lightgray", hatch="//")
            ax.text(i, top, "identical", ha="center", va="bottom", fontsize="small")
        elif r.psnr_high_vs_lossless_db is not None:
            db = r.psnr_high_vs_lossless_db
            ax.bar(i, db, color="tab:green" if db >= PSNR_BAR_DB else "tab:red")
            ax.text(i, db, f"{db:.1f}", ha="center", va="bottom", fontsize="small")
    ax.axhline(PSNR_BAR_DB, color="black", linestyle="--", linewidth=1)
    ax.text(len(rows) - 0.5, PSNR_BAR_DB, f" {PSNR_BAR_DB:.0f} dB", va="bottom", ha="right")
    ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=20, ha="right")
    ax.set_ylim(0, top * 1.1)
    ax.set_ylabel("PSNR of high against lossless, dB")
    ax.set_title("Quality of high (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def crop_caption(r: CaseResult, max_diff: int) -> str:
    c = r.crops
    top, left, h, w = c.get("box", [0, 0, 0, 0])
    where = (f"frame {c['frame']} of {c['of_frames']}, " if c.get("frame") is not None else "")
    return (f"Left: lossless; middle: high; right: |high - lossless| x {DIFF_GAIN} in 8-bit "
            f"levels (clipped at 255; largest difference {max_diff} levels). Center crop "
            f"{h}x{w} at ({top}, {left}) of the {'x'.join(map(str, c.get('image_size', [])))} "
            f"output, {where}8-bit.")


def plot_crops(plt, r: CaseResult, crops: dict, path: pathlib.Path) -> int | None:
    """Lossless | high | amplified difference; returns the largest difference (8-bit levels)."""
    import numpy as np

    lossless, high = crops.get(r.crops.get("lossless")), crops.get(r.crops.get("high"))
    if lossless is None or high is None:
        return None
    diff = np.abs(high.astype(np.int16) - lossless.astype(np.int16))
    amplified = np.clip(diff * DIFF_GAIN, 0, 255).astype(np.uint8)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.4))
    titles = ("lossless", "high", f"|high - lossless| x {DIFF_GAIN}")
    for ax, image, title in zip(axes, (lossless, high, amplified), titles, strict=True):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(title)
        ax.axis("off")
    fig.suptitle(r.label)
    fig.tight_layout(rect=(0, 0, 1, 0.94))  # leave the top for the suptitle
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return int(diff.max())


def write_report(json_path: str, out_dir: str, crops_npz: str | None = None,
                 crops_dir: str | None = None, convs_json: str | None = None) -> pathlib.Path:
    """Write ``out_dir``/README.md and its PNG plots; returns the README's path."""
    plt = require_matplotlib()
    from .crops import load_crops

    env, results = read_json(json_path)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {}
    if plot_times(plt, results, out / "time.png"):
        plots["time"] = "time.png"
    if plot_psnr(plt, results, out / "psnr.png"):
        plots["psnr"] = "psnr.png"
    crops = load_crops(crops_npz, crops_dir) if (crops_npz or crops_dir) else {}
    figures = {}
    for r in measured(results):
        if not r.crops:
            continue
        name = f"crop-{r.crops['lossless'].removesuffix('-lossless')}.png"
        max_diff = plot_crops(plt, r, crops, out / name)
        if max_diff is not None:
            figures[r.label] = (name, crop_caption(r, max_diff))
    readme = out / "README.md"
    convs = None
    if convs_json:
        from .convs import read_json as read_convs

        convs = read_convs(convs_json)
    readme.write_text(report_markdown(env, results, plots, figures, convs), encoding="utf-8")
    return readme
