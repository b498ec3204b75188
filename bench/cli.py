"""Command line: ``python -m fast_vae_decode <demo|bench|report> [options]``; ``main(argv)`` for
tests."""
from __future__ import annotations

import argparse
import atexit
import os
import shlex
import shutil
import sys
import tempfile

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _default_dtype(device: torch.device) -> torch.dtype:
    # bf16 is ComfyUI's VAE dtype on current GPUs; CPUs run fp32 (bf16 convs are slow there).
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_parser() -> argparse.ArgumentParser:
    from .cases import CASES, DEFAULT_CASES
    from .models import ARCHS

    parser = argparse.ArgumentParser(
        prog="python -m fast_vae_decode",
        description="Fast VAE Decode: demo on an embedded model, benchmark against stock, "
                    "report a benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="decode with a seeded random-weight SDXL VAE (no ComfyUI, no downloads)",
        description="Decodes one seeded latent at quality lossless and high with a seeded "
                    "random-weight SDXL-architecture VAE and writes the high image.")
    demo.add_argument("--size", type=int, default=None,
                      help="image side in pixels (default 1024 on CUDA, 256 on CPU)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="default bf16 on CUDA, fp32 on CPU")
    demo.add_argument("--out", default="fast_vae_decode_demo.png",
                      help="image to write (PNG; PPM without Pillow or with a .ppm name)")
    demo.add_argument("--arch", default="sdxl",
                      choices=[a for a in ARCHS if a in ("sdxl", "sd15", "flux")]
                      + ["tiny_sdxl", "tiny_sd15", "tiny_flux"],
                      help="image VAE architecture (tiny_* are small test variants)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--repeats", type=int, default=None,
                      help="timed decodes per quality (default 5 on CUDA, 1 on CPU)")

    bench = sub.add_parser(
        "bench", help="time stock vs lossless vs high per case; Markdown table + JSON",
        description="Measures stock, lossless and high decodes side by side in one process "
                    "(CUDA events, warm-up, median). With a ComfyUI tree (--comfyui or "
                    "COMFYUI_PATH) stock is ComfyUI's VAEDecode and the fast paths go through "
                    "the FastVAEDecode node; without, diffusers models are used.")
    bench.add_argument("--cases", default=None,
                       help=f"comma-separated (default: {','.join(DEFAULT_CASES)}); "
                            f"also: {','.join(n for n in CASES if n not in DEFAULT_CASES)}")
    bench.add_argument("--list-cases", action="store_true", help="print the cases and exit")
    bench.add_argument("--comfyui", default=None,
                       help="ComfyUI tree to load in-process (default: $COMFYUI_PATH)")
    bench.add_argument("--comfyui-args", default="",
                       help="more ComfyUI command-line flags, after '=' since they start "
                            "with dashes (e.g. --comfyui-args='--fp32-vae')")
    bench.add_argument("--no-comfyui", action="store_true",
                       help="use diffusers models even when COMFYUI_PATH is set")
    bench.add_argument("--device", default=None,
                       help="default: cuda if available (with ComfyUI: ComfyUI's VAE device)")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="default: ComfyUI's VAE dtype; diffusers: bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--repeats", type=int, default=None,
                       help="timed decodes per path (default 11 for images, 3 for video)")
    bench.add_argument("--burn-in", dest="burn_in", type=float, default=None, metavar="SECONDS",
                       help="untimed stock decodes of the first case before any timing "
                            "(default 3 s on CUDA, 0 on the CPU)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed decodes before timing")
    bench.add_argument("--precisions", default="fp32,fp16,bf16",
                       help="Wan decode precisions to add as rows, comma-separated, or 'none'")
    bench.add_argument("--run-unsupported", action="store_true",
                       help="measure cases that no fast-path family supports yet")
    bench.add_argument("--json", dest="json_path", default=None, help="write results here")
    bench.add_argument("--crops", dest="crops_dir", default=None, metavar="DIR",
                       help="save a center crop of each row's lossless and high output here "
                            "(<case>[-<precision>]-lossless.png / -high.png; .npy without "
                            "Pillow)")
    bench.add_argument("--crops-npz", default=None, metavar="PATH",
                       help="all crops in one .npz (keys = those file names without "
                            "extension): one file to bring back, read by 'report'")
    bench.add_argument("--crop-size", type=int, default=256,
                       help="crop side in pixels (the whole image when smaller)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--report", dest="report_dir", default=None, metavar="DIR",
                       help="also write the Markdown report and PNG plots (as the 'report' "
                            "command does) into DIR; needs --json and matplotlib")
    bench.add_argument("--kl-setting", action="append", default=[], metavar="NAME=VALUE",
                       help="override a field of fastpath.kl_settings.settings for this run, "
                            "e.g. attention=sdpa or comfy_output_fp32=false (repeatable)")
    bench.add_argument("--host-malloc", choices=("steady", "system"), default="steady",
                       help="steady (default): glibc keeps freed CPU memory, so ComfyUI's "
                            "CPU-side output handling does not page-fault it in again every "
                            "decode (as in a long-running server; see bench/hostmem.py); "
                            "system: leave malloc as it is")
    bench.add_argument("--triton-cache", choices=("fresh", "keep"), default="fresh",
                       help="fresh (default): compile into an empty Triton cache, so the first "
                            "high decode shows the cold compile cost; keep: use the usual cache")
    report = sub.add_parser(
        "report", help="Markdown report + PNG plots from a bench JSON (needs matplotlib)",
        description="Writes OUT/README.md (environment, command, every row) and plots: time "
                    "per case, PSNR per row, and for rows with crops lossless | high | their "
                    "amplified difference.")
    report.add_argument("--json", dest="json_path", required=True, help="bench --json output")
    report.add_argument("--crops-npz", default=None, metavar="PATH", help="bench --crops-npz")
    report.add_argument("--crops", dest="crops_dir", default=None, metavar="DIR",
                        help="bench --crops folder (when there is no .npz)")
    report.add_argument("--out", default="docs/benchmark", help="folder for README.md + PNGs")
    return parser


def _report(args) -> int:
    from .report import write_report

    try:
        readme = write_report(args.json_path, args.out, crops_npz=args.crops_npz,
                              crops_dir=args.crops_dir)
    except RuntimeError as exc:  # matplotlib missing
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {readme}")
    return 0


def _fresh_triton_cache() -> None:
    path = tempfile.mkdtemp(prefix="fvd-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def _quiet_diffusers() -> None:
    try:
        from diffusers.utils import logging as diffusers_logging
    except Exception:
        return
    diffusers_logging.set_verbosity_error()


def _demo(args) -> int:
    from .demo import DemoOptions, run_demo

    device = torch.device(args.device) if args.device else _default_device()
    dtype = _dtype(args.dtype) or _default_dtype(device)
    run_demo(DemoOptions(device=device, dtype=dtype, size=args.size, out=args.out,
                         arch=args.arch, seed=args.seed, repeats=args.repeats))
    return 0


def _apply_kl_setting(item: str) -> None:
    """Set one KL fast-path setting from NAME=VALUE, typed like the field's default."""
    from ..fastpath.families.kl.settings import settings

    name, sep, text = item.partition("=")
    if not sep or not hasattr(settings, name):
        raise ValueError(f"--kl-setting expects NAME=VALUE with NAME one of "
                         f"{', '.join(vars(settings))}; got {item!r}")
    current = getattr(settings, name)
    if isinstance(current, bool) or current is None:
        value = {"true": True, "false": False, "none": None}.get(text.lower())
        if value is None and text.lower() != "none":
            raise ValueError(f"--kl-setting {name} takes true, false or none; got {text!r}")
    elif isinstance(current, int):
        value = int(text)
    else:
        value = text
    setattr(settings, name, value)


def _bench(args, parser: argparse.ArgumentParser) -> int:
    from .cases import CASES, select_cases
    from .comfyui import ENV_VAR

    if args.list_cases:
        for case in CASES.values():
            print(f"{case.name:16} {case.arch:11} {list(case.latent_shape)}  {case.note}")
        return 0
    from .run import BenchOptions, run_bench

    comfyui = None if args.no_comfyui else (args.comfyui or os.environ.get(ENV_VAR) or None)
    device = torch.device(args.device) if args.device else None
    dtype = _dtype(args.dtype)
    if comfyui is None:
        device = device or _default_device()
        dtype = dtype or _default_dtype(device)
    precisions = [] if args.precisions == "none" else [
        p.strip() for p in args.precisions.split(",") if p.strip()]
    try:
        cases = select_cases(args.cases)
    except ValueError as exc:
        parser.error(str(exc))
    if args.report_dir and not args.json_path:
        parser.error("--report needs --json (the report is made from the saved results)")
    for item in args.kl_setting:
        try:
            _apply_kl_setting(item)
        except ValueError as exc:
            parser.error(str(exc))
    if args.triton_cache == "fresh":
        _fresh_triton_cache()
    host_malloc = "system"
    if args.host_malloc == "steady":
        from .hostmem import keep_freed_host_memory

        host_malloc = keep_freed_host_memory()
    options = BenchOptions(cases=cases, device=device, dtype=dtype,
                           comfyui=comfyui, comfyui_args=shlex.split(args.comfyui_args),
                           repeats=args.repeats, warmup=args.warmup, burn_in_s=args.burn_in,
                           precisions=precisions, run_unsupported=args.run_unsupported,
                           seed=args.seed, json_path=args.json_path,
                           crops_dir=args.crops_dir, crops_npz=args.crops_npz,
                           crop_size=args.crop_size, host_malloc=host_malloc)
    results = run_bench(options)
    status = 1 if any(r.error for r in results) else 0
    if args.report_dir:
        args.out = args.report_dir
        status = max(status, _report(args))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_diffusers()
    if args.command == "demo":
        return _demo(args)
    if args.command == "report":
        return _report(args)
    return _bench(args, parser)


if __name__ == "__main__":
    sys.exit(main())
