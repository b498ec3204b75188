"""Command line: ``python -m fast_vae_decode <demo|bench|convs|attention|report|modes> [options]``;
``main(argv)`` for tests.

A user mistake never ends in a traceback: what argparse itself rejects (an unknown option, a
malformed number) is reported by the subcommand's parser (its usage, then one line); a value
checked here (a missing file, a device this machine lacks, a size the VAE cannot decode) is one
line on stderr naming what was expected. Both exit with status 2.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
from typing import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROG = "python -m fast_vae_decode"
REPORT_SUFFIX = "-report"  # report's default folder: <json stem>-report/ beside the JSON


class UsageError(Exception):
    """A user mistake found after parsing: ``main`` says it in one line and returns 2."""


# bench --host-copies: (HostCopy.memmove, HostCopy.parts, PixelSettings.cast_latent_on_device);
# "auto" is the pack's own defaults.
# bench --triton-launch: kept compiled kernels launched directly (kernels/direct_launch.py), or
# Triton's own dispatch on every launch.
TRITON_LAUNCH = ("direct", "jit")
TRITON_LAUNCH_HELP = ("direct (default): a Triton kernel met before is launched straight from "
                      "its compiled kernel; jit: through Triton's dispatch on every launch (to "
                      "measure what the direct launch saves)")
HOST_COPIES = {"auto": None, "pooled": (False, 4, False), "single": (True, 1, True),
               "split": (True, 4, True)}

def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device(text: str | None) -> torch.device | None:
    """``--device`` as a torch device this machine has, or UsageError saying what is expected."""
    if text is None:
        return None
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device expects cpu, cuda or cuda:N; got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: this machine has no CUDA GPU that torch can use "
                             "(torch.cuda.is_available() is False); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: expected cuda:0 to cuda:"
                             f"{torch.cuda.device_count() - 1} on this machine")
    return device


def _count(minimum: int):
    """argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _existing(path: str | None, flag: str, what: str, folder: bool = False) -> None:
    if path is None:
        return
    ok = pathlib.Path(path).is_dir() if folder else pathlib.Path(path).is_file()
    if not ok:
        raise UsageError(f"{flag} {path}: no such {'folder' if folder else 'file'} "
                         f"(expected {what})")


def _writable_place(path: str | None, flag: str) -> None:
    """The folder a file named by ``flag`` goes into must exist (checked before any work)."""
    if path is None:
        return
    parent = pathlib.Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist "
                         "(expected a file name in an existing folder)")


def default_report_dir(json_path: str) -> pathlib.Path:
    """Where ``report`` writes without ``--out``: a new folder beside the JSON, never the
    committed ``docs/benchmark``."""
    path = pathlib.Path(json_path)
    return path.with_name(path.stem + REPORT_SUFFIX)


def _default_dtype(device: torch.device) -> torch.dtype:
    # bf16 is ComfyUI's VAE dtype on current GPUs; CPUs run fp32 (bf16 convs are slow there).
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _add_decode_options(parser: argparse.ArgumentParser, cases_help: str, device_help: str) -> None:
    """What to decode and where, for the subcommands that decode in this process (``interleave``,
    ``profile``): the cases, the ComfyUI tree and flags or diffusers, device and dtype."""
    parser.add_argument("--cases", default=None, help=cases_help)
    parser.add_argument("--comfyui", default=None, help="ComfyUI tree (default: $COMFYUI_PATH)")
    parser.add_argument("--comfyui-args", default="", help="ComfyUI flags, after '='")
    parser.add_argument("--no-comfyui", action="store_true",
                        help="use diffusers models even when COMFYUI_PATH is set")
    parser.add_argument("--device", default=None, help=device_help)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)


def build_parser() -> argparse.ArgumentParser:
    from .attention import ATTENTION_CASES, CANDIDATES, config_name
    from .cases import CASES, DEFAULT_CASES, TINY_CASES
    from .convs import CONV_CASES
    from .demo import DEFAULT_OUT
    from .models import ARCHS

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fast VAE Decode: demo on an embedded model, benchmark against stock, "
                    "report a benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="decode with a seeded random-weight SDXL VAE (no ComfyUI, no downloads)",
        description="Decodes one seeded latent at quality lossless and high with a seeded "
                    "random-weight SDXL-architecture VAE and writes the high image (random "
                    "weights: it looks like coloured noise).")
    demo.add_argument("--size", type=_count(1), default=None,
                      help="image side in pixels, a multiple of the VAE's upscale (8; 2 for "
                           "tiny_*) (default 1024 on CUDA, 256 on CPU)")
    demo.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: cuda if available)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="default bf16 on CUDA, fp32 on CPU")
    demo.add_argument("--out", default=DEFAULT_OUT,
                      help="image to write (PNG; PPM without Pillow or with a .ppm name); "
                           "default: %(default)s")
    demo.add_argument("--arch", default="sdxl",
                      choices=[a for a in ARCHS if a in ("sdxl", "sd15", "flux")]
                      + ["tiny_sdxl", "tiny_sd15", "tiny_flux"],
                      help="image VAE architecture (tiny_* are small test variants)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--repeats", type=_count(1), default=None,
                      help="timed decodes per quality (default 5 on CUDA, 1 on CPU)")
    demo.set_defaults(parser=demo, run=_demo)

    bench = sub.add_parser(
        "bench", help="time stock vs lossless vs high per case; Markdown table + JSON",
        description="Measures stock, lossless and high decodes side by side in one process "
                    "(CUDA events, warm-up, median). With a ComfyUI tree (--comfyui or "
                    "COMFYUI_PATH) stock is ComfyUI's VAEDecode and the fast paths go through "
                    "the FastVAEDecode node; without, diffusers models are used.")
    bench.add_argument("--cases", default=None,
                       help=f"comma-separated (default: {','.join(DEFAULT_CASES)}; without a "
                            f"CUDA GPU: {','.join(TINY_CASES)}); "
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
                       help="cpu, cuda or cuda:N; default: cuda if available (with ComfyUI: "
                            "ComfyUI's VAE device)")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="default: ComfyUI's VAE dtype; diffusers: bf16 on CUDA, fp32 on CPU")
    bench.add_argument("--repeats", type=_count(1), default=None,
                       help="timed decodes per path (default 11 for images and one-frame video, 3 for longer video)")
    bench.add_argument("--burn-in", dest="burn_in", type=float, default=None, metavar="SECONDS",
                       help="untimed stock decodes of the first case before any timing "
                            "(default 3 s on CUDA, 0 on the CPU)")
    bench.add_argument("--warmup", type=_count(0), default=1,
                       help="untimed decodes before timing")
    bench.add_argument("--precisions", default="fp32,fp16,bf16",
                       help=f"Wan decode precisions to add as rows, comma-separated from "
                            f"{', '.join(sorted(DTYPES))}, or 'none'")
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
    bench.add_argument("--crop-size", type=_count(1), default=256,
                       help="crop side in pixels (the whole image when smaller)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--report", dest="report_dir", default=None, metavar="DIR",
                       help="also write the Markdown report and PNG plots (as the 'report' "
                            "command does) into DIR; needs --json and matplotlib")
    bench.add_argument("--kl-setting", action="append", default=[], metavar="NAME=VALUE",
                       help="override a KL fast-path setting (fastpath/families/kl/settings.py) "
                            "for this run, e.g. attention=sdpa or comfy_output_fp32=false "
                            f"(repeatable); names: {', '.join(_kl_setting_names())}")
    bench.add_argument("--wan-setting", action="append", default=[], metavar="NAME=VALUE",
                       help="override a Wan fast-path setting (fastpath/families/wan/settings.py)"
                            f" for this run (repeatable); names: "
                            f"{', '.join(_setting_fields('wan'))}")
    bench.add_argument("--triton-launch", choices=TRITON_LAUNCH, default=None,
                       help=TRITON_LAUNCH_HELP)
    bench.add_argument("--pixel-finish", choices=("pack", "comfyui"), default="pack",
                       help="pack (default): decoded pixels finished on the GPU and copied to "
                            "host memory once by this pack; comfyui: ComfyUI's own VAE.decode "
                            "output handling (to measure what the pack's still gains)")
    bench.add_argument("--host-copies", choices=tuple(HOST_COPIES), default="auto",
                       help="auto (default): the pack's own choice (latent cast on the GPU; an "
                            "output's copy-out by memmove in parts on the pack's threads up "
                            "to 32 MiB, by torch above); pooled: the latent cast and every "
                            "copy-out by torch on the host (its OpenMP pool); single: every "
                            "copy-out as one "
                            "memmove; split: every copy-out as a memmove in parts (to measure "
                            "what the pool's spinning threads cost)")
    bench.add_argument("--host-malloc", choices=("steady", "system"), default="steady",
                       help="steady (default): glibc keeps freed CPU memory, so ComfyUI's "
                            "CPU-side output handling does not page-fault it in again every "
                            "decode (as in a long-running server; see bench/hostmem.py); "
                            "system: leave malloc as it is")
    bench.add_argument("--triton-cache", choices=("fresh", "keep"), default="fresh",
                       help="fresh (default): compile into an empty Triton cache, so the first "
                            "high decode shows the cold compile cost; keep: use the usual cache")
    bench.add_argument("--paths", choices=("all", "high"), default="all",
                       help="all (default): stock, lossless and high; high: only high is timed "
                            "(no stock, lossless or fp32 reference), as 'modes' runs it")
    bench.set_defaults(parser=bench, run=_bench)
    convs = sub.add_parser(
        "convs", help="per-conv benchmark: each decoder conv shape, cuDNN vs implicit_gemm_conv",
        description="Collects every distinct convolution of the cases' decoders (forward hooks "
                    "on the meta device), as the fused path runs them, and times each on "
                    "cuDNN (channels-last bf16) and on the pack's implicit_gemm_conv (CUDA "
                    "only; --shapes-only lists them anywhere).")
    convs.add_argument("--cases", default=",".join(CONV_CASES),
                       help="comma-separated bench cases (default: %(default)s)")
    convs.add_argument("--shapes-only", action="store_true",
                       help="list the shapes and their calls per decode; time nothing")
    convs.add_argument("--repeats", type=_count(1), default=5, help="timed calls per path")
    convs.add_argument("--sweep", type=_count(0), default=16, metavar="N",
                       help="also try the other tilings on the N heaviest shapes and the heads "
                            "(default %(default)s; 0: default tiling only, heads apart)")
    convs.add_argument("--kinds", default=None,
                       help="time only these kinds, comma-separated (e.g. head,conv_in)")
    convs.add_argument("--ops", default=None,
                       help="time only these of the pack's ops, comma-separated (implicit_gemm_conv, "
                            "narrow_conv, winograd_conv, padded_grid_conv)")
    convs.add_argument("--json", dest="json_path", default=None, help="write results here")
    convs.add_argument("--cudnn-graph", action="store_true",
                       help="also time cuDNN's graph API on the 2-D convs: the conv with its "
                            "bias + residual epilogue, with genstats, with a norm+SiLU prologue, "
                            "against the conv and the pack's pass (needs the optional "
                            "nvidia-cudnn-frontend)")
    convs.add_argument("--gemm-bound", action="store_true",
                       help="also time a cuBLAS GEMM of each conv's own M x N x K: the most an "
                            "implicit-GEMM conv from any library reaches without fusion "
                            "(bench/gemm_bound.py)")
    convs.add_argument("--comfyui", default=None, metavar="PATH",
                       help="a ComfyUI tree, for cases whose convs are recorded from one fused "
                            "decode on ComfyUI's own model (LTX-2)")
    convs.set_defaults(parser=convs, run=_convs)

    attention = sub.add_parser(
        "attention", help="the KL mid-block attention per call: chunked softmax, SDPA and "
                          "exp_scores (each tile config) at the cases' sizes",
        description="Times the KL mid-block's single-head attention (bf16, 512 channels, the "
                    "cases' latent pixels as tokens) on each path the fused decode can take, "
                    "with each path's error against an fp32 attention on the first rows (CUDA; "
                    "the CPU only under TRITON_INTERPRET, for tests).")
    attention.add_argument("--cases", default=",".join(ATTENTION_CASES),
                           help="comma-separated KL bench cases (default: %(default)s)")
    attention.add_argument("--configs", default=",".join(config_name(c) for c in CANDIDATES),
                           help="exp_scores tile configs, BMxBNxBKwWARPSsSTAGES (t at the end: "
                                "the persistent TMA kernel), comma-separated "
                                "(default: %(default)s; the first is the kernel's default)")
    attention.add_argument("--repeats", type=_count(1), default=10, help="timed calls per path")
    attention.add_argument("--device", default=None, help="cuda (default) or cuda:N")
    attention.add_argument("--json", dest="json_path", default=None, help="write results here")
    attention.set_defaults(parser=attention, run=_attention)

    report = sub.add_parser(
        "report", help="Markdown report + PNG plots from a bench JSON (needs matplotlib)",
        description="Writes OUT/README.md (environment, command, every row) and plots: time "
                    "per case, PSNR per row, and for rows with crops lossless | high | their "
                    "amplified difference.")
    report.add_argument("--json", dest="json_path", required=True, help="bench --json output")
    report.add_argument("--crops-npz", default=None, metavar="PATH", help="bench --crops-npz")
    report.add_argument("--crops", dest="crops_dir", default=None, metavar="DIR",
                        help="bench --crops folder (when there is no .npz)")
    report.add_argument("--convs-json", default=None, metavar="PATH",
                        help="a 'convs --json' file: its tables join the report")
    report.add_argument("--out", default=None,
                        help="folder for README.md + PNGs (default: a new folder beside the "
                             f"JSON, <json stem>{REPORT_SUFFIX}/, e.g. bench.json -> "
                             f"bench{REPORT_SUFFIX}/)")
    report.set_defaults(parser=report, run=_report)

    modes = sub.add_parser(
        "modes", help="high under ComfyUI's default flags against other flags, in alternating "
                      "bench processes (e.g. dynamic VRAM against --disable-dynamic-vram)",
        description="Runs 'bench' in rounds, each round once with ComfyUI's default flags and "
                    "once with --against (the side going first flips every round), and prints "
                    "each side's high time per case (median of the rounds' medians, with their "
                    "spread) and how the default side compares. Needs a ComfyUI tree.")
    modes.add_argument("--comfyui", default=None, metavar="PATH",
                       help="ComfyUI tree (default: $COMFYUI_PATH)")
    modes.add_argument("--against", default=None, metavar="FLAGS",
                       help="ComfyUI flags of the other side, given with '=' "
                            "(--against='--novram'); default: --disable-dynamic-vram, or none "
                            "with --against-bench")
    modes.add_argument("--against-bench", default="", metavar="OPTIONS",
                       help="bench options of the other side only, given with '=' "
                            "(--against-bench='--host-copies single'): compares a setting of "
                            "this pack under the same ComfyUI flags")
    modes.add_argument("--bench-args", default="", metavar="OPTIONS",
                       help="bench options of both sides, given with '=' "
                            "(--bench-args='--host-copies single')")
    modes.add_argument("--cases", default="sdxl-1024,qwen-1024",
                       help="comma-separated bench cases (default: %(default)s)")
    modes.add_argument("--rounds", type=_count(1), default=3, help="rounds (default %(default)s)")
    modes.add_argument("--out", default=None,
                       help="folder for each round's bench JSON (default: a temporary folder)")
    modes.set_defaults(parser=modes, run=_modes, no_comfyui=False)

    inter = sub.add_parser(
        "interleave", help="the pack's run-time switches against each other on high, in one "
                           "process, the variants taking turns decode by decode",
        description="Decodes each case at quality high once per round under every --variant, "
                    "in a shuffled order, and prints each variant's median against the first. "
                    "A variant sets --host-copies, --kl-setting, --wan-setting and "
                    "--triton-launch as bench takes them, from the switches as this process "
                    "has them (ComfyUI flags need 'modes').")
    inter.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                       help="repeatable, at least two, the first the baseline; e.g. "
                            "--variant=pooled='--host-copies pooled' --variant=auto=")
    _add_decode_options(inter, f"comma-separated bench cases (default: {','.join(DEFAULT_CASES)}; "
                               f"without a CUDA GPU: {','.join(TINY_CASES)})", "cpu, cuda or cuda:N")
    inter.add_argument("--stock", action="store_true",
                       help="ComfyUI's VAEDecode, on a copy of the model the pack never installs in, "
                            "takes its turn in every round too (one --variant is then enough; "
                            "none: high as set), and each variant's speed-up over it is the "
                            "median of the rounds' ratios")
    inter.add_argument("--rounds", type=_count(1), default=15, help="default %(default)s")
    inter.add_argument("--warmup", type=_count(0), default=2,
                       help="untimed decodes per variant first (default %(default)s)")
    inter.add_argument("--host-malloc", choices=("steady", "system"), default="steady",
                       help="as bench's")
    inter.add_argument("--seed", type=int, default=0)
    inter.add_argument("--json", dest="json_path", default=None, help="write the times here")
    inter.set_defaults(parser=inter, run=_interleave)

    prof = sub.add_parser(
        "profile", help="where one decode's GPU time goes and how long the GPU waits on the "
                        "host (torch profiler trace, summarised; CUDA only)",
        description="Decodes each case a few times, then once under torch's profiler, and "
                    "prints the GPU's busy and idle time (idle split into host-late and queued, "
                    "and over the decode's span), kernel time by kind, the largest kernels and "
                    "the largest gaps. Run-time switches as bench takes them.")
    _add_decode_options(prof, f"comma-separated bench cases (default: {','.join(DEFAULT_CASES)})",
                        "cuda or cuda:N")
    prof.add_argument("--quality", choices=("high", "lossless"), default="high")
    prof.add_argument("--warmup", type=_count(0), default=3,
                      help="untimed decodes first (default %(default)s)")
    prof.add_argument("--decodes", type=_count(1), default=5,
                      help="timed decodes without the profiler, for the wall time "
                           "(default %(default)s)")
    prof.add_argument("--kl-setting", action="append", default=[], metavar="NAME=VALUE",
                      help="as bench's")
    prof.add_argument("--wan-setting", action="append", default=[], metavar="NAME=VALUE",
                      help="as bench's")
    prof.add_argument("--host-copies", choices=sorted(HOST_COPIES), default=None,
                      help="as bench's")
    prof.add_argument("--triton-launch", choices=TRITON_LAUNCH, default=None, help="as bench's")
    prof.add_argument("--top", type=_count(1), default=15, help="kernels listed (default %(default)s)")
    prof.add_argument("--host-top", type=_count(0), default=0, metavar="N",
                      help="also run one decode under cProfile and list the N functions the "
                           "host spent most time in (default %(default)s: not run)")
    prof.add_argument("--timeline", action="store_true",
                      help="also record one unprofiled decode's module calls with CUDA events: "
                           "where the GPU waited for the host, per decoder call (the profiler "
                           "slows the host, so its host-late idle overstates that)")
    prof.add_argument("--seed", type=int, default=0)
    prof.add_argument("--json", dest="json_path", default=None,
                      help="write each case's summary here")
    prof.set_defaults(parser=prof, run=_profile)
    return parser


def _modes(args, runner=None) -> int:
    from . import flag_rounds

    tree = _comfyui_tree(args)
    if tree is None:
        raise UsageError("needs a ComfyUI tree: --comfyui PATH or COMFYUI_PATH")
    against = args.against
    if against is None:
        against = "" if args.against_bench else "--disable-dynamic-vram"
    try:
        sides = flag_rounds.sides_for(against, args.against_bench)
        extra = tuple(shlex.split(args.bench_args))
    except ValueError as exc:  # no flags, or unbalanced quotes
        raise UsageError(f"--against: {exc}") from None
    out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="fvd-modes-"))
    times = flag_rounds.run_rounds(str(pathlib.Path(tree).resolve()), args.cases, sides,
                                   args.rounds, out, runner, extra)
    print(flag_rounds.compare_table(times, sides, args.cases.split(",")))
    print(f"(each round's bench JSON: {out})")
    return 0 if times else 1


def _report(args) -> int:
    from .report import write_report
    from .results import read_json

    _existing(args.json_path, "--json", "the JSON file that 'bench --json' wrote")
    _existing(args.crops_npz, "--crops-npz", "the .npz file that 'bench --crops-npz' wrote")
    _existing(args.crops_dir, "--crops", "the folder that 'bench --crops' wrote", folder=True)
    try:
        read_json(args.json_path)
    except (ValueError, TypeError, KeyError) as exc:  # not JSON, another schema, odd rows
        raise UsageError(f"--json {args.json_path}: expected a 'bench --json' result file "
                         f"({type(exc).__name__}: {exc})".splitlines()[0]) from None
    convs_json = getattr(args, "convs_json", None)
    _existing(convs_json, "--convs-json", "the JSON file that 'convs --json' wrote")
    out = args.out if args.out is not None else default_report_dir(args.json_path)
    try:
        readme = write_report(args.json_path, str(out), crops_npz=args.crops_npz,
                              crops_dir=args.crops_dir, convs_json=convs_json)
    except RuntimeError as exc:  # matplotlib missing
        raise UsageError(str(exc)) from None
    print(f"wrote {readme}")
    return 0


def _attention(args) -> int:
    from ..kernels.backend import interpreting
    from . import attention
    from .cases import select_cases
    from .convs import environment

    try:
        cases = select_cases(args.cases)
        for case in cases:
            attention.tokens_of(case)
        configs = [attention.parse_config(c) for c in args.configs.split(",") if c.strip()]
    except ValueError as exc:
        raise UsageError(f"--cases / --configs: {exc}") from None
    _writable_place(args.json_path, "--json")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise UsageError("timing the attention needs a CUDA GPU (or TRITON_INTERPRET=1 on the "
                         "CPU, for tests)")
    results = attention.time_attention(cases, configs, repeats=args.repeats, device=device)
    print(attention.attention_markdown(results))
    if args.json_path:
        attention.write_json(args.json_path, results, environment())
    return 0 if all(r.error is None for r in results) else 1


def _convs(args) -> int:
    from . import convs
    from .cases import select_cases

    try:
        cases = select_cases(args.cases)
    except ValueError as exc:
        raise UsageError(f"--cases: {exc}") from None
    _writable_place(args.json_path, "--json")
    if not args.shapes_only and not torch.cuda.is_available():
        raise UsageError("timing the convs needs a CUDA GPU; --shapes-only lists them here")
    if args.cudnn_graph:
        from .cudnn_graph import unavailable_reason

        reason = "--shapes-only times nothing" if args.shapes_only else unavailable_reason()
        if reason is not None:
            raise UsageError(f"--cudnn-graph: {reason}")
    if args.gemm_bound and args.shapes_only:
        raise UsageError("--gemm-bound: --shapes-only times nothing")
    recorded = [c.name for c in cases if convs.recorded(c)]
    if recorded and args.comfyui is None:
        raise UsageError(f"--cases {','.join(recorded)}: their convs are recorded from a fused "
                         "decode on ComfyUI's own model; give --comfyui PATH")
    if args.comfyui is not None:
        from .comfyui import comfyui_path, setup_comfyui

        try:
            setup_comfyui(comfyui_path(args.comfyui))
        except FileNotFoundError as exc:
            raise UsageError(f"--comfyui {args.comfyui}: {exc}") from None
    shapes = convs.distinct_shapes(convs.collect_conv_shapes(cases, comfyui=args.comfyui is not None))
    if args.shapes_only:
        results = [convs.ConvResult(shape, calls) for shape, calls in shapes]
    else:
        _fresh_triton_cache()
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None
        ops = tuple(o.strip() for o in args.ops.split(",")) if args.ops else None
        results = convs.time_convs(shapes, repeats=args.repeats, sweep=args.sweep, kinds=kinds,
                                   ops=ops, log=lambda line: print(line, flush=True))
    print(convs.convs_markdown(results), flush=True)
    if args.cudnn_graph:
        from . import cudnn_graph

        cudnn_graph.time_graphs(results, log=lambda line: print(line, flush=True))
        print(cudnn_graph.graph_markdown(results), flush=True)
    if args.gemm_bound:
        from . import gemm_bound

        gemm_bound.time_gemms(results, repeats=args.repeats,
                              log=lambda line: print(line, flush=True))
        print(gemm_bound.gemm_markdown(results), flush=True)
    if args.json_path:
        convs.write_json(args.json_path, results, convs.environment())
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
    from .demo import DemoOptions, output_size, run_demo

    device = _device(args.device) or _default_device()
    dtype = _dtype(args.dtype) or _default_dtype(device)
    try:
        output_size(args.arch, args.size, device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _writable_place(args.out, "--out")
    run_demo(DemoOptions(device=device, dtype=dtype, size=args.size, out=args.out,
                         arch=args.arch, seed=args.seed, repeats=args.repeats))
    return 0


# The families whose fast path has run-time settings (``--kl-setting``, ``--wan-setting``).
SETTING_MODULES = {"kl": "fastpath.families.kl.settings", "wan": "fastpath.families.wan.settings"}


def _settings_module(family: str):
    import importlib

    return importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.{SETTING_MODULES[family]}")


def _setting_fields(family: str) -> dict[str, object]:
    module = _settings_module(family)
    return {f.name: f.type for f in dataclasses.fields(type(module.settings))}


def _kl_setting_names() -> list[str]:
    return list(_setting_fields("kl"))


def _setting_values(family: str, name: str) -> dict[str, object] | None:
    """The values ``--FAMILY-setting NAME=`` takes, by their spelling; None for any integer."""
    choices = _settings_module(family).CHOICES
    if name in choices:
        return {choice: choice for choice in choices[name]}
    annotation = str(_setting_fields(family)[name])
    if "bool" in annotation:
        values: dict[str, object] = {"true": True, "false": False}
        if "None" in annotation:
            values["none"] = None
        return values
    if annotation == "int":
        return None
    raise TypeError(f"{family} setting {name}: no choices declared for {annotation}")


def _apply_setting(family: str, item: str) -> None:
    """Set one fast-path setting of ``family`` from NAME=VALUE; UsageError for an unknown name
    or value."""
    flag = f"--{family}-setting"
    names = list(_setting_fields(family))
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or name not in names:
        raise UsageError(f"{flag} expects NAME=VALUE with NAME one of {', '.join(names)}; "
                         f"got {item!r}")
    values = _setting_values(family, name)
    text = text.strip()
    if values is None:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{flag} {name} expects an integer; got {text!r}") from None
    elif text.lower() in values:
        value = values[text.lower()]
    else:
        raise UsageError(f"{flag} {name} expects one of {', '.join(values)}; got {text!r}")
    setattr(_settings_module(family).settings, name, value)


def _apply_kl_setting(item: str) -> None:
    _apply_setting("kl", item)


def _apply_switches(host_copies: str | None, kl_settings: list[str],
                    triton_launch: str | None = None, wan_settings: list[str] = ()) -> None:
    """Set the pack's run-time switches as ``--host-copies``, ``--kl-setting``,
    ``--wan-setting`` and ``--triton-launch`` say."""
    for item in kl_settings:
        _apply_setting("kl", item)
    for item in wan_settings:
        _apply_setting("wan", item)
    if triton_launch is not None:
        from ..kernels.direct_launch import launch_settings

        launch_settings.direct = triton_launch == "direct"
    if host_copies is not None and HOST_COPIES[host_copies] is not None:
        from ..fastpath.pixels.decode import pixel_settings
        from ..fastpath.pixels.finish import host_copy

        host_copy.memmove, host_copy.parts, pixel_settings.cast_latent_on_device = \
            HOST_COPIES[host_copies]


STOCK_BEFORE_INSTALL_DECODES = 3


def installed_models(vae) -> list:
    """The decoder models of ``vae`` that the pack has installed its fused modules in."""
    from ..fastpath.gate import decoder_models
    from ..fastpath.install import install_report

    return [m for m in decoder_models(vae) if install_report(m) is not None]


def _stock_before_install(subject, warmup: int) -> list[float]:
    """Stock decodes timed before the pack has installed anything on this VAE (after
    ``warmup`` untimed ones, at least one: the first loads the model)."""
    from .timing import timed_call

    for _ in range(max(1, warmup)):
        subject.stock()
    return [timed_call(subject.stock, subject.device)[0]
            for _ in range(STOCK_BEFORE_INSTALL_DECODES)]


def _path_of(result) -> str | None:
    """What a decode reported: the pack's UI text for high, "stock" for VAEDecode's images."""
    if isinstance(result, torch.Tensor):
        return "stock"
    return result[1].get("text")


def _interleave(args) -> int:
    from . import interleave
    from .cases import TINY_CASES
    from .run import log
    from .subjects import build_subject, release
    from .timing import timed_call

    try:
        variants = interleave.parse_variants(args.variant, stock=args.stock)
    except ValueError as exc:
        raise UsageError(f"--variant: {exc}") from None
    parser = interleave.options_parser(tuple(HOST_COPIES), TRITON_LAUNCH)
    chosen = {}
    for v in variants:
        try:
            opts, extra = parser.parse_known_args(list(v.options))
        except argparse.ArgumentError as exc:
            raise UsageError(f"--variant {v.name}: {exc}") from None
        if extra:
            raise UsageError(f"--variant {v.name}: only --host-copies, --kl-setting, "
                             f"--wan-setting and --triton-launch can "
                             f"change within a process; got {' '.join(extra)}")
        chosen[v.name] = opts
    comfyui, device, dtype = _backend(args)
    cases = _cases(args, device)
    switches = interleave.Switches()
    for opts in chosen.values():  # every value checked before any model is built
        _apply_switches(opts.host_copies, opts.kl_setting, opts.triton_launch, opts.wan_setting)
        switches.restore()

    def apply(opts) -> Callable[[], None]:
        def set_variant() -> None:
            switches.restore()
            _apply_switches(opts.host_copies, opts.kl_setting, opts.triton_launch, opts.wan_setting)
        return set_variant

    applies = {name: apply(opts) for name, opts in chosen.items()}
    nodes, version, note = None, None, None
    if comfyui is not None:
        from .comfyui import comfyui_path, comfyui_version, memory_mode, setup_comfyui

        path = comfyui_path(comfyui)
        nodes, version = setup_comfyui(path, shlex.split(args.comfyui_args)), comfyui_version(path)
        note = interleave.stock_note(memory_mode()) if args.stock else None
    host_malloc = "system"
    if args.host_malloc == "steady":
        from .hostmem import keep_freed_host_memory

        host_malloc = keep_freed_host_memory()
        log(f"host malloc: {host_malloc}")
    results: dict[str, interleave.Interleaved] = {}
    stock_before: dict[str, list[float]] = {}
    try:
        with torch.inference_mode():
            for case in cases:
                subject = build_subject(case, nodes=nodes, device=device, dtype=dtype,
                                        seed=args.seed)
                twin = None
                try:
                    decodes, rows = {}, applies
                    if args.stock:
                        stock_before[case.name] = _stock_before_install(subject, args.warmup)
                        # Once installed, a model's closed gate decodes through the pack's
                        # bit-exact cheaper paths (what lossless runs), faster than ComfyUI's
                        # own code: the stock row decodes a twin the pack never touches.
                        twin = build_subject(case, nodes=nodes, device=device, dtype=dtype,
                                             seed=args.seed)
                        decodes = {interleave.STOCK: twin.stock}
                        rows = {interleave.STOCK: switches.restore, **applies}
                    results[case.name] = interleave.run_interleaved(
                        lambda s=subject: s.decode("high"), rows, args.rounds, args.warmup,
                        lambda fn, s=subject: timed_call(fn, s.device), seed=args.seed,
                        path_of=_path_of, decodes=decodes)
                    if twin is not None and installed_models(twin.vae):
                        raise RuntimeError(f"{case.name}: the stock twin got the fast path")
                finally:
                    release(twin)
                    release(subject)
                log(f"{case.name}: {args.rounds} rounds of {len(variants)} variants")
    finally:
        switches.restore()
    print(interleave.summary_table(results, variants, stock_before))
    if note:
        print("\n" + note)
    if args.json_path:
        import json

        from .run import BenchOptions, environment

        # The bench's own environment record (commit, versions, GPU, memory mode, the switches
        # as the process had them), then what this run compared.
        options = BenchOptions(cases=cases, device=device, dtype=dtype, comfyui=comfyui,
                               comfyui_args=shlex.split(args.comfyui_args), warmup=args.warmup,
                               seed=args.seed, host_malloc=host_malloc)
        data = {**environment(options, version),
                "variants": {v.name: list(v.options) for v in variants}, "rounds": args.rounds,
                "times_ms": {c: r.times for c, r in results.items()},
                "paths": {c: r.paths for c, r in results.items()},
                "stock_before_install_ms": stock_before, "stock_note": note,
                "small_cases": all(c.name in TINY_CASES for c in cases)}
        pathlib.Path(args.json_path).write_text(json.dumps(data, indent=1))
    return 0


def _profile(args) -> int:
    from . import gpu_profile
    from .subjects import build_subject, release
    from .timing import timed_call

    comfyui, device, dtype = _backend(args)
    if (device or _default_device()).type != "cuda":
        raise UsageError("profile needs a CUDA GPU (it summarises the GPU's kernels and gaps)")
    _writable_place(args.json_path, "--json")
    cases = _cases(args, device)
    # every value checked before any model is built
    _apply_switches(args.host_copies, args.kl_setting, args.triton_launch, args.wan_setting)
    nodes = None
    if comfyui is not None:
        from .comfyui import comfyui_path, setup_comfyui

        nodes = setup_comfyui(comfyui_path(comfyui), shlex.split(args.comfyui_args))
    summaries = {}
    with torch.inference_mode():
        for case in cases:
            subject = build_subject(case, nodes=nodes, device=device, dtype=dtype, seed=args.seed)
            try:
                def decode(s=subject):
                    return s.decode(args.quality)

                for _ in range(args.warmup):
                    decode()
                walls = [timed_call(decode, subject.device)[0] for _ in range(args.decodes)]
                line = None
                if args.timeline:
                    from ..fastpath.gate import decoder_models
                    from . import timeline

                    line = timeline.record(decoder_models(subject.vae)[0], decode, subject.device)
                profiled, trace, (_, info) = gpu_profile.profile_decode(decode, subject.device)
                path = info.get("text", "")
                host = None
                if args.host_top:
                    from . import host_profile

                    stats, _ = host_profile.profile_host(decode)
                    host = host_profile.host_markdown(stats, args.host_top)
            finally:
                release(subject)
            summary = gpu_profile.analyse_trace(trace, top=args.top)
            print(gpu_profile.summary_markdown(f"{case.name} ({path or args.quality})", walls,
                                               profiled, summary))
            print()
            if line is not None:
                print(timeline.timeline_markdown(line))
                print()
            if host:
                print(host)
            summaries[case.name] = {"wall_ms": walls, "profiled_wall_ms": profiled,
                                    "path": path, **dataclasses.asdict(summary)}
            if line is not None:
                summaries[case.name]["timeline"] = dataclasses.asdict(line)
    if args.json_path:
        import json

        pathlib.Path(args.json_path).write_text(json.dumps(summaries, indent=1))
    return 0


def _backend(args) -> tuple[str | None, torch.device | None, torch.dtype | None]:
    """(ComfyUI tree, device, dtype): without a tree, diffusers' device and dtype by default;
    with one, None where ComfyUI chooses."""
    comfyui = _comfyui_tree(args)
    device = _device(args.device)
    dtype = _dtype(args.dtype)
    if comfyui is None:
        device = device or _default_device()
        dtype = dtype or _default_dtype(device)
    return comfyui, device, dtype


def _comfyui_tree(args):
    """The ComfyUI tree to load (checked now, before any work), or None for diffusers."""
    from .comfyui import ENV_VAR, comfyui_path

    if args.no_comfyui:
        return None
    raw, source = args.comfyui, "--comfyui"
    if raw is None:
        raw, source = os.environ.get(ENV_VAR) or None, f"{ENV_VAR}="
    if raw is None:
        return None
    try:
        comfyui_path(raw)
    except FileNotFoundError as exc:
        hint = "" if source == "--comfyui" else "; --no-comfyui uses diffusers models instead"
        raise UsageError(f"{source}{'' if source.endswith('=') else ' '}{raw}: {exc}{hint}"
                         ) from None
    return raw


def _precisions(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        raise UsageError(f"--precisions expects a comma-separated list of "
                         f"{', '.join(sorted(DTYPES))}, or none; got {text!r}")
    return names


def _cases(args, device: torch.device | None):
    """The cases to run: ``--cases``, else the full-size ones, or the tiny ones without a GPU
    (the full-size cases take minutes each on a CPU)."""
    from .cases import TINY_CASES, select_cases
    from .run import log

    try:
        cases = select_cases(args.cases)
    except ValueError as exc:
        raise UsageError(f"--cases: {exc}") from None
    if args.cases is None and (device or _default_device()).type == "cpu":
        cases = select_cases(",".join(TINY_CASES))
        log(f"no --cases and no CUDA device: running the small CPU cases {', '.join(TINY_CASES)} "
            "(the default cases are GPU-sized; name them with --cases to run them anyway)")
    return cases


def _bench(args) -> int:
    from .cases import CASES

    if args.list_cases:
        for case in CASES.values():
            print(f"{case.name:16} {case.arch:11} {list(case.latent_shape)}  {case.note}")
        return 0
    from .run import BenchOptions, run_bench

    comfyui, device, dtype = _backend(args)
    precisions = _precisions(args.precisions)
    try:
        comfyui_args = shlex.split(args.comfyui_args)
    except ValueError as exc:
        raise UsageError(f"--comfyui-args: expected ComfyUI flags as a shell would split them "
                         f"({exc})") from None
    if args.report_dir and not args.json_path:
        raise UsageError("--report needs --json (the report is made from the saved results)")
    for flag, path in (("--json", args.json_path), ("--crops-npz", args.crops_npz)):
        _writable_place(path, flag)
    _apply_switches(args.host_copies, args.kl_setting, args.triton_launch, args.wan_setting)
    if args.pixel_finish == "comfyui":
        from ..fastpath.pixels.decode import pixel_settings

        pixel_settings.device_finish = False
    cases = _cases(args, device)
    if args.triton_cache == "fresh":
        _fresh_triton_cache()
    host_malloc = "system"
    if args.host_malloc == "steady":
        from .hostmem import keep_freed_host_memory

        host_malloc = keep_freed_host_memory()
    options = BenchOptions(cases=cases, device=device, dtype=dtype,
                           comfyui=comfyui, comfyui_args=comfyui_args,
                           repeats=args.repeats, warmup=args.warmup, burn_in_s=args.burn_in,
                           precisions=precisions, run_unsupported=args.run_unsupported,
                           seed=args.seed, json_path=args.json_path,
                           crops_dir=args.crops_dir, crops_npz=args.crops_npz,
                           crop_size=args.crop_size, host_malloc=host_malloc,
                           high_only=args.paths == "high")
    results = run_bench(options)
    status = 1 if any(r.error for r in results) else 0
    if args.report_dir:
        args.out = args.report_dir
        status = max(status, _report(args))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand, with its usage (argparse would use the top level's)
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _quiet_diffusers()
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
