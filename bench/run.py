"""``python -m fast_vae_decode bench``: stock vs lossless vs high, side by side, in one process.

Per case: stock first (ComfyUI's ``VAEDecode`` before anything is installed; its output is the
reference), then the very first high decode (install + kernel compilation, timed alone), then
high and lossless (warm-up, then the median of the timed calls), then one more stock decode to
check that installing changed nothing for a stock node. Everything runs under
``torch.inference_mode()`` as ComfyUI's executor does.
"""
from __future__ import annotations

import gc
import math
import os
import pathlib
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ..fastpath.cuda_graph import graph_bytes, graph_status
from ..fastpath.gate import decoder_models
from .cases import Case, select_cases
from .results import CaseResult, markdown_table, write_json
from .subjects import Subject, build_subject, release, unsupported_reason
from .timing import all_finite, measure, psnr_db, timed_call, to_unit_range

MIB = 1024.0 * 1024.0


@dataclass
class BenchOptions:
    cases: list[Case]
    device: torch.device | None = None  # None: ComfyUI's VAE device (diffusers needs one)
    dtype: torch.dtype | None = None  # None: ComfyUI's VAE dtype (diffusers needs one)
    comfyui: str | None = None  # a ComfyUI tree; None = diffusers models
    comfyui_args: list[str] = field(default_factory=list)  # more ComfyUI command-line flags
    repeats: int | None = None  # None: 11 for images, 3 for video
    # Untimed stock decodes of the first case, for this many seconds, before anything is timed
    # (None: 3 s on CUDA, none on the CPU): the first seconds of a run on a lent GPU host were
    # the unsteady ones (stock 94-113 ms there, 88-89 ms in every later case of the same run).
    burn_in_s: float | None = None
    warmup: int = 1
    precisions: list[str] = field(default_factory=lambda: ["fp32", "fp16", "bf16"])
    run_unsupported: bool = False
    seed: int = 0
    json_path: str | None = None
    crops_dir: str | None = None  # center crops of lossless / high per row, as PNG files
    crops_npz: str | None = None  # ... and/or all of them in one .npz
    crop_size: int = 256
    host_malloc: str = "system"  # what bench.hostmem did, if anything
    # Only ``high`` is timed (no stock, lossless or fp32 reference): what ``modes`` compares
    # between ComfyUI's flag sets, in a third of a full bench process's time.
    high_only: bool = False
    crop_store: Any = field(default=None, repr=False)  # a bench.crops.CropStore, set by run_bench


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def repeats_for(case: Case, options: BenchOptions) -> int:
    # 11 for images: the fast image path is host-bound enough that single decodes jump (a median
    # of 5 moved by 2-4 ms between runs on one host); video decodes are long and steady. A
    # one-frame "video" (Qwen-Image through the Wan VAE) is an image decode of ~20 ms whose
    # single decodes jumped 19 -> 27 ms in one run: a median of 3 is one of those jumps.
    if options.repeats is not None:
        return options.repeats
    return 3 if case.video and case.latent_shape[2] > 1 else 11


def burn_in(subject: Subject, options: BenchOptions) -> int:
    """Untimed stock decodes for ``options.burn_in_s`` seconds (at least one); returns how many."""
    seconds = options.burn_in_s
    if seconds is None:
        seconds = 3.0 if subject.device.type == "cuda" else 0.0
    if seconds <= 0:
        return 0
    done, start = 0, time.perf_counter()
    while done == 0 or time.perf_counter() - start < seconds:
        subject.stock()
        done += 1
    log(f"burn-in: {done} untimed stock decodes in {time.perf_counter() - start:.1f} s")
    return done


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _with_graph_pools(peak: int | None, subject: Subject) -> int | None:
    """A replayed decode allocates nothing: its activations live in the CUDA-graph pool,
    allocated at capture and held since, so the peak it reaches is counted with the pool."""
    if peak is None:
        return None
    return peak + sum(graph_bytes(m) for m in decoder_models(subject.vae))


def _graph_status(subject: Subject) -> str:
    """What the CUDA-graph replay did on the last high decode ("replayed", or why not)."""
    status = [s for m in decoder_models(subject.vae) for s in graph_status(m)]
    return "; ".join(status) or "not graphed"


def measure_subject(case: Case, subject: Subject, options: BenchOptions,
                    result: CaseResult, fp32_reference: torch.Tensor | None = None) -> CaseResult:
    """Measure one subject; ``fp32_reference`` is the case's decode by an fp32 copy of the model
    as loaded (precision rows are compared with the same one)."""
    repeats = repeats_for(case, options)
    device = subject.device
    result.device, result.dtype = str(device), str(subject.dtype).replace("torch.", "")
    result.repeats = repeats
    if options.high_only:
        return _measure_high(subject, options, result)

    stock = measure(subject.stock, device, repeats, options.warmup)
    reference = stock.output
    log(f"{result.label}: stock {stock.median_ms:.1f} ms")
    if fp32_reference is not None:
        result.psnr_stock_vs_fp32_db = _finite(psnr_db(
            to_unit_range(reference, subject.signed), to_unit_range(fp32_reference, subject.signed)))

    # Lossless right after stock, before any fused decode: the fold buffers a fused decode
    # keeps move the allocator's block rounding for every later decode, stock's too (LTX-2:
    # up to 0.6 MiB), so stock and lossless peaks compare only from the same allocator state.
    lossless = measure(lambda: subject.decode("lossless"), device, repeats, options.warmup)
    lossless_images, lossless_info = lossless.output
    log(f"{result.label}: lossless {lossless.median_ms:.1f} ms")

    first_ms, (_, first_info) = timed_call(lambda: subject.decode("high"), device)
    high = measure(lambda: subject.decode("high"), device, repeats, options.warmup)
    high_images, high_info = high.output
    result.cuda_graph = _graph_status(subject)
    log(f"{result.label}: high {high.median_ms:.1f} ms (first {first_ms:.1f} ms) "
        f"[{high_info.get('text', '')}] CUDA graph: {result.cuda_graph}")

    stock_again = measure(subject.stock, device, 1, warmup=0)

    result.output_shape = list(reference.shape)
    result.stock_ms, result.high_ms, result.lossless_ms = (
        stock.median_ms, high.median_ms, lossless.median_ms)
    result.high_speedup = stock.median_ms / high.median_ms
    result.lossless_speedup = stock.median_ms / lossless.median_ms
    result.times_ms = {"stock": stock.times_ms, "high": high.times_ms,
                       "lossless": lossless.times_ms}
    result.peak_extra_mib = {"stock": _mib(stock.peak_extra_bytes),
                             "lossless": _mib(lossless.peak_extra_bytes),
                             "high": _mib(_with_graph_pools(high.peak_extra_bytes, subject)),
                             "stock_after_fused": _mib(stock_again.peak_extra_bytes)}
    result.first_high_ms = first_ms
    result.first_high_overhead_ms = first_ms - high.median_ms
    result.high_path, result.high_info = high_info.get("text"), high_info
    result.high_progress_updates = high_info.pop("progress_updates", None)
    result.high_progress_ms = high_info.pop("progress_ms", None)
    for key in ("progress_updates", "progress_ms"):
        first_info.pop(key, None)
    result.high_info["first_call"] = first_info
    result.lossless_path = lossless_info.get("text")
    result.high_finite = all_finite(high_images)
    result.lossless_bit_exact = torch.equal(lossless_images, reference)
    result.stock_bit_exact_after_install = torch.equal(stock_again.output, reference)
    psnr = psnr_db(to_unit_range(high_images, subject.signed),
                   to_unit_range(lossless_images, subject.signed))
    result.high_identical_to_lossless = psnr == math.inf
    result.psnr_high_vs_lossless_db = psnr if math.isfinite(psnr) else None
    if fp32_reference is not None:
        result.psnr_high_vs_fp32_db = _finite(psnr_db(
            to_unit_range(high_images, subject.signed), to_unit_range(fp32_reference, subject.signed)))
    if options.crop_store is not None:
        from .crops import crop_stem

        result.crops = options.crop_store.add(
            crop_stem(case.name, result.precision),
            {"lossless": lossless_images, "high": high_images},
            signed=subject.signed, video=case.video)
    log(f"{result.label}: high {result.high_speedup:.2f}x, lossless "
        f"{result.lossless_speedup:.2f}x, PSNR "
        f"{'identical' if result.high_identical_to_lossless else f'{psnr:.1f} dB'}, "
        f"lossless bit-exact {result.lossless_bit_exact}")
    return result


def _measure_high(subject: Subject, options: BenchOptions, result: CaseResult) -> CaseResult:
    first_ms, _ = timed_call(lambda: subject.decode("high"), subject.device)
    high = measure(lambda: subject.decode("high"), subject.device, result.repeats, options.warmup)
    high_images, high_info = high.output
    result.high_ms, result.first_high_ms = high.median_ms, first_ms
    result.times_ms = {"high": high.times_ms}
    result.peak_extra_mib = {"high": _mib(_with_graph_pools(high.peak_extra_bytes, subject))}
    result.high_path, result.high_finite = high_info.get("text"), all_finite(high_images)
    result.cuda_graph = _graph_status(subject)
    log(f"{result.label}: high {high.median_ms:.1f} ms (first {first_ms:.1f} ms) "
        f"[{result.high_path or ''}] CUDA graph: {result.cuda_graph}")
    return result


def _precision_rows(case: Case, subject: Subject, options: BenchOptions,
                    base: CaseResult, fp32_reference) -> list[CaseResult]:
    from ..fastpath.families.wan.precision import with_decoder_precision

    rows = []
    for precision in options.precisions:
        row = CaseResult(case.name, case.arch, list(case.latent_shape), subject.backend, precision)
        try:
            variant = subject.with_vae(with_decoder_precision(subject.vae, precision))
        except NotImplementedError as exc:
            row.skipped = f"decode precision not implemented yet ({exc})"
        except Exception as exc:  # the precision node refuses this VAE: report, keep going
            row.skipped = f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            _guarded(measure_subject, row, case, variant, options, row, fp32_reference)
            if base.stock_ms and row.high_ms:
                row.high_speedup_vs_base_stock = base.stock_ms / row.high_ms
            del variant
        rows.append(row)
        if row.skipped:
            log(f"{row.label}: skipped ({row.skipped})")
    return rows


def _guarded(work, row: CaseResult, *args) -> None:
    try:
        work(*args)
    except Exception as exc:  # one failing case must not lose the others' numbers
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log(f"{row.label}: ERROR {row.error}")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()


def _fp32_reference(subject: Subject, row: CaseResult) -> torch.Tensor | None:
    """The case decoded by an fp32 copy of its model, before anything is installed."""
    if subject.fp32 is None:
        return None
    try:
        reference = subject.fp32()
    except Exception as exc:  # e.g. out of memory for the fp32 copy: the row just lacks it
        log(f"{row.label}: no fp32 reference ({type(exc).__name__}: {exc})".splitlines()[0])
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return reference


def run_case(case: Case, options: BenchOptions, nodes, first: bool = False) -> list[CaseResult]:
    backend = "comfyui" if nodes is not None else "diffusers"
    base = CaseResult(case.name, case.arch, list(case.latent_shape), backend)
    subject = None
    rows = [base]
    try:
        log(f"{case.name}: building {backend} {case.arch} VAE, latent {list(case.latent_shape)}")
        subject = build_subject(case, nodes=nodes, device=options.device, dtype=options.dtype,
                                seed=options.seed)
        reason = unsupported_reason(subject)
        if reason is not None and not options.run_unsupported:
            base.skipped = reason
            log(f"{case.name}: skipped ({reason})")
            return rows
        if first:
            burn_in(subject, options)
        fp32_reference = None if options.high_only else _fp32_reference(subject, base)
        _guarded(measure_subject, base, case, subject, options, base, fp32_reference)
        if case.video and options.precisions and base.error is None:
            rows += _precision_rows(case, subject, options, base, fp32_reference)
    except Exception as exc:
        base.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log(f"{case.name}: ERROR {base.error}")
        traceback.print_exc(file=sys.stderr)
    finally:
        release(subject)
        subject = None  # drop the model before asking the allocator to give memory back
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def environment(options: BenchOptions, comfyui_version: str | None) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "device": str(options.device or "ComfyUI's VAE device"), "comfyui": options.comfyui,
            "comfyui_args": options.comfyui_args,
            "comfyui_version": comfyui_version, "seed": options.seed,
            "warmup": options.warmup, "repeats": options.repeats,
            "burn_in_s": options.burn_in_s,
            "argv": sys.argv[1:]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for name in ("triton", "diffusers"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    from ..kernels.backend import triton_unavailable_reason

    info["triton_unavailable"] = triton_unavailable_reason()
    info["host_malloc"] = options.host_malloc
    info["commit"] = pack_commit()
    from ..fastpath.pixels.decode import pixel_settings

    info["pixel_finish"] = "pack" if pixel_settings.device_finish else "comfyui"
    from ..fastpath.pixels.finish import host_copy

    memmove = f"memmove in {host_copy.parts} parts" if host_copy.parts > 1 else "one memmove"
    copy_out = {None: f"{memmove} up to {host_copy.memmove_max_bytes >> 20} MiB, else torch",
                True: memmove, False: "torch"}[host_copy.memmove]
    latent = "device" if pixel_settings.cast_latent_on_device else "host"
    info["host_copies"] = f"copy-out: {copy_out}; latent cast on the {latent}"
    from ..kernels.direct_launch import direct_launch_unavailable_reason, launch_settings

    reason = direct_launch_unavailable_reason()
    info["triton_launch"] = ("jit" if not launch_settings.direct
                             else "direct" if reason is None else f"jit ({reason})")
    if options.comfyui is not None:
        from .comfyui import memory_mode

        info["comfyui_memory_mode"] = memory_mode()
    return info


COMMIT_ENV = "FAST_VAE_DECODE_COMMIT"


def pack_commit() -> str | None:
    """The pack's git commit (with "+dirty" for uncommitted changes), if it is a checkout.

    ``$FAST_VAE_DECODE_COMMIT`` wins: a copy of the tree made elsewhere (a remote GPU machine's)
    may carry a ``.git`` whose HEAD is not the commit of the files it runs.
    """
    import subprocess

    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]

    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_bench(options: BenchOptions) -> list[CaseResult]:
    nodes, version = None, None
    if options.comfyui is not None:
        from .comfyui import comfyui_path, comfyui_version, setup_comfyui

        path = comfyui_path(options.comfyui)
        log(f"loading ComfyUI from {path}")
        nodes, version = setup_comfyui(path, options.comfyui_args), comfyui_version(path)
    env = environment(options, version)
    log(f"torch {env['torch']}, triton {env['triton']}, diffusers {env['diffusers']}, "
        f"ComfyUI {version or 'not used'} ({env.get('comfyui_memory_mode', '-')}), device {env.get('gpu', env['device'])}")
    if options.crops_dir or options.crops_npz:
        from .crops import CropStore

        options.crop_store = CropStore(options.crops_dir, options.crops_npz, options.crop_size)
    results: list[CaseResult] = []
    with torch.inference_mode():
        for i, case in enumerate(options.cases):
            results += run_case(case, options, nodes, first=i == 0)
            # Rewritten after each case, so a cut-off run keeps its numbers and crops.
            if options.json_path:
                write_json(options.json_path, env, results)
            if options.crop_store is not None:
                options.crop_store.flush()
    print(markdown_table(results), flush=True)
    if options.json_path:
        write_json(options.json_path, env, results)
        log(f"wrote {options.json_path}")
    if options.crop_store is not None:
        log(f"wrote crops: {', '.join(p for p in (options.crops_dir, options.crops_npz) if p)}")
    return results


__all__ = ["BenchOptions", "run_bench", "run_case", "measure_subject", "select_cases"]
