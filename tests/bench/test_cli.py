"""The command-line entry: ``demo`` and ``bench`` run end to end on tiny models (tier 1, CPU).

The CLI runs in-process through ``bench.cli.main(argv)``; one subprocess checks that running the
checkout by path (``python <repo> ...``) finds its package. Nothing here times anything: the
bench's numbers are only checked for presence and type, its correctness flags for value.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from fast_vae_decode.bench.cli import main
from fast_vae_decode.bench.results import SCHEMA, read_json
from support.cli import run_cli

# Every field a measured row must carry (the later Markdown/plot report reads these).
MEASURED_FIELDS = (
    "case", "arch", "latent_shape", "backend", "precision", "device", "dtype", "output_shape",
    "repeats", "stock_ms", "lossless_ms", "high_ms", "lossless_speedup", "high_speedup",
    "psnr_high_vs_lossless_db", "high_identical_to_lossless", "high_finite",
    "lossless_bit_exact", "stock_bit_exact_after_install", "peak_extra_mib", "first_high_ms",
    "first_high_overhead_ms", "high_path", "lossless_path", "times_ms",
)

# Cheapest settings that still run every step once: no warm-up, one timed decode per path,
# the usual Triton cache (a fresh one would only cost compile time), never ComfyUI here.
QUICK = ["--repeats", "1", "--warmup", "0", "--triton-cache", "keep", "--no-comfyui"]


def test_demo_writes_the_high_image(tmp_path):
    pytest.importorskip("diffusers")
    target = tmp_path / "demo.ppm"  # PPM: readable back without Pillow
    # 32 px: the tiny SDXL-structured VAE upsamples 2x, so a 16x16 latent (interpreter-cheap).
    code, text = run_cli(["demo", "--arch", "tiny_sdxl", "--size", "32", "--device", "cpu",
                          "--out", str(target)])
    assert code == 0
    assert "lossless:" in text and "high:" in text and "PSNR high vs lossless" in text
    assert "random weights" in text and "coloured noise" in text  # why the picture is noise
    (did,) = [line for line in text.splitlines() if line.startswith("On this machine high")]
    if "[fallback: " in text:  # stock path (no Triton, no GPU): the node's reason is given
        reason = text.split("[fallback: ", 1)[1].split("]", 1)[0]
        assert "fell back to the stock path" in did and reason in did
    else:
        assert "ran the fast path" in did
    header = target.read_bytes()[:11]
    assert header == b"P6\n32 32\n255\n"[:11]
    assert target.stat().st_size == len(b"P6\n32 32\n255\n") + 32 * 32 * 3


@pytest.fixture(scope="module")
def kl_bench(tmp_path_factory):
    """One bench run of the tiny SDXL case with the fused path running (interpreter on CPU)."""
    pytest.importorskip("diffusers")
    path = tmp_path_factory.mktemp("bench") / "kl.json"
    code, text = run_cli(["bench", "--cases", "tiny-sdxl", "--json", str(path), *QUICK])
    return code, text, json.loads(path.read_text()), path


def test_bench_writes_json_with_every_field(kl_bench):
    code, text, data, path = kl_bench
    assert code == 0
    assert data["schema"] == SCHEMA
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    assert data["environment"]["host_malloc"]  # what bench/hostmem.py did: steady or system
    assert data["environment"]["host_copies"].startswith("copy-out: memmove in 4 parts up to")
    (row,) = data["results"]
    assert row["skipped"] is None and row["error"] is None, row
    for name in MEASURED_FIELDS:
        assert name in row, name
    assert row["backend"] == "diffusers" and row["case"] == "tiny-sdxl"
    for decode in ("stock", "high", "lossless"):
        assert len(row["times_ms"][decode]) == 1
        assert row[f"{decode}_ms"] > 0
    assert row["output_shape"] == [1, 3, 16, 16]
    assert "| tiny-sdxl | as loaded | diffusers | float32 |" in text  # the Markdown table row
    _, (result,) = read_json(str(path))  # what a later report reads back
    assert result.label == "tiny-sdxl" and result.lossless_ms == row["lossless_ms"]


def test_bench_reports_lossless_bit_exact_and_a_finite_high(kl_bench):
    _, _, data, _ = kl_bench
    (row,) = data["results"]
    assert row["lossless_bit_exact"] is True
    assert row["stock_bit_exact_after_install"] is True
    assert row["high_finite"] is True
    if row["high_path"].startswith("high:"):  # the fused path ran (interpreter or GPU)
        assert row["high_identical_to_lossless"] is False
        assert math.isfinite(row["psnr_high_vs_lossless_db"])
    else:  # it fell back: then high is the stock computation
        assert row["high_identical_to_lossless"] is True


def test_bench_paths_high_times_only_high(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    import fast_vae_decode.bench.run as run

    def no_fp32_reference(subject, row):  # the fp32 decode is what --paths high leaves out
        raise AssertionError("--paths high built an fp32 reference")

    monkeypatch.setattr(run, "_fp32_reference", no_fp32_reference)
    path = tmp_path / "high.json"
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--paths", "high", "--json", str(path),
                       "--burn-in", "0", *QUICK])
    assert code == 0
    (row,) = json.loads(path.read_text())["results"]
    assert row["error"] is None, row
    assert list(row["times_ms"]) == ["high"] and row["high_ms"] > 0 and row["high_finite"]
    assert row["stock_ms"] is None and row["lossless_ms"] is None
    assert row["high_path"]  # the node's text: fused or why not


def test_bench_video_case_with_a_precision_row(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    # Stock path for high here (the interpreter would run the Wan kernels slowly); this test is
    # about the video case and the precision rows, not the fused path.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = tmp_path / "wan.json"
    code, _ = run_cli(["bench", "--cases", "tiny-wan21", "--precisions", "fp32",
                       "--json", str(path), *QUICK])
    assert code == 0
    base, variant = json.loads(path.read_text())["results"]
    assert base["precision"] is None and base["lossless_bit_exact"] is True
    assert base["output_shape"] == [1, 3, 5, 32, 32]  # 2 latent frames -> 1 + 4 video frames
    assert variant["precision"] == "fp32"
    if variant["skipped"] is None:
        assert variant["error"] is None, variant
        assert variant["lossless_bit_exact"] is True
        assert variant["high_speedup_vs_base_stock"] > 0


def test_bench_lists_cases_and_rejects_unknown_ones():
    code, text = run_cli(["bench", "--list-cases"])
    assert code == 0 and "sdxl-1024" in text and "wan22-704p-33" in text
    code, _ = run_cli(["bench", "--cases", "sdxl-4096", *QUICK])  # one line, before any work
    assert code == 2


def test_running_the_checkout_by_path_finds_the_package():
    result = subprocess.run([sys.executable, str(REPO), "bench", "--list-cases"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tiny-wan22" in result.stdout


# ``python -m fast_vae_decode`` run in the checkout, emulated with runpy from ``-c`` (which puts
# the working directory on sys.path as ``-m`` does), then asking where ``kernels`` resolves.
MODULE_RUN = """
import importlib.util, runpy, sys
sys.argv = ["fast_vae_decode", "bench", "--list-cases"]
try:
    runpy.run_module("fast_vae_decode", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(importlib.util.find_spec("kernels").origin)
"""


def test_running_the_module_in_the_checkout_leaves_installed_packages_unshadowed(tmp_path):
    """An installed top-level ``kernels`` (Hugging Face's, which newer transformers import
    through diffusers) stays what ``import kernels`` finds: the checkout's ``kernels/`` folder
    must not shadow it."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    (site / "fast_vae_decode").symlink_to(REPO, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    result = subprocess.run([sys.executable, "-c", MODULE_RUN], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tiny-wan22" in result.stdout  # the command ran
    assert result.stdout.strip().splitlines()[-1] == str(site / "kernels" / "__init__.py")


def test_bench_burns_in_on_the_first_case_only(monkeypatch):
    """``burn_in_s``: untimed stock decodes of the first case before anything is timed."""
    from fast_vae_decode.bench import run as bench_run
    from fast_vae_decode.bench.cases import select_cases

    built = []
    real_build = bench_run.build_subject

    def counting_build(*args, **kwargs):
        subject = real_build(*args, **kwargs)
        calls = {"stock": 0}
        stock = subject.stock

        def counted():
            calls["stock"] += 1
            return stock()

        subject.stock = counted
        built.append(calls)
        return subject

    monkeypatch.setattr(bench_run, "build_subject", counting_build)
    options = bench_run.BenchOptions(cases=select_cases("tiny-sdxl,tiny-flux"), device=torch.device("cpu"),
                                     dtype=torch.float32, repeats=1, warmup=0, precisions=[],
                                     burn_in_s=0.01)
    results = bench_run.run_bench(options)
    assert all(r.error is None for r in results)
    # Each case times stock once, plus one stock decode after install; the first case also
    # burned in (at least one untimed decode).
    assert built[0]["stock"] > built[1]["stock"] >= 2


# --- user mistakes: one line naming what was expected, exit status 2, no traceback ------------


def _one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_report_of_a_missing_json_says_which_file(tmp_path, capsys):
    err = _one_line_error(capsys, ["report", "--json", str(tmp_path / "missing.json")])
    assert err.startswith("python -m fast_vae_decode report: error: --json ")
    assert "missing.json: no such file" in err and "bench --json" in err


def test_report_of_a_json_that_is_not_a_bench_result(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"schema": "something else"}')
    err = _one_line_error(capsys, ["report", "--json", str(path)])
    assert "expected a 'bench --json' result file" in err


def test_demo_on_cuda_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["demo", "--device", "cuda"])
    assert "no CUDA GPU" in err and "--device cpu" in err
    err = _one_line_error(capsys, ["demo", "--device", "gpu0"])
    assert "--device expects cpu, cuda or cuda:N" in err


def test_demo_size_must_fit_the_vae(capsys):
    err = _one_line_error(capsys, ["demo", "--size", "100", "--device", "cpu"])
    assert "--size expects a positive multiple of 8 for sdxl" in err and "got 100" in err


def test_demo_out_in_a_missing_folder(tmp_path, capsys):
    err = _one_line_error(capsys, ["demo", "--device", "cpu", "--arch", "tiny_sdxl",
                                   "--out", str(tmp_path / "nowhere" / "x.png")])
    assert "--out" in err and "does not exist" in err


def test_bench_with_a_comfyui_path_that_is_not_a_tree(tmp_path, capsys, monkeypatch):
    err = _one_line_error(capsys, ["bench", "--comfyui", str(tmp_path / "nowhere")])
    assert "--comfyui" in err and "is not a ComfyUI tree (expected a folder holding nodes.py" in err
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    err = _one_line_error(capsys, ["bench"])
    assert f"COMFYUI_PATH={tmp_path}:" in err and "--no-comfyui" in err


def test_bench_rejects_unknown_precisions(capsys):
    err = _one_line_error(capsys, ["bench", "--precisions", "fp8", *QUICK])
    assert "--precisions expects" in err and "'fp8'" in err


@pytest.mark.parametrize("item, expected", [
    ("attention=flash", "--kl-setting attention expects one of auto, chunked, sdpa"),
    ("upsample=bicubic", "--kl-setting upsample expects one of transposed, subpixel, stock"),
    ("comfy_output_fp32=none", "--kl-setting comfy_output_fp32 expects one of true, false;"),
    ("chunked_min_tokens=many", "--kl-setting chunked_min_tokens expects an integer"),
    ("atention=sdpa", "--kl-setting expects NAME=VALUE with NAME one of attention,"),
    ("attention", "--kl-setting expects NAME=VALUE"),
])
def test_kl_setting_rejects_an_unknown_name_or_value(item, expected, capsys):
    from fast_vae_decode.fastpath.families.kl.settings import KLSettings, settings

    err = _one_line_error(capsys, ["bench", "--kl-setting", item, *QUICK])
    assert expected in err
    assert settings == KLSettings()  # nothing was changed


@pytest.mark.parametrize("item, expected", [
    ("attention=flash", "--wan-setting attention expects one of auto, chunked, sdpa"),
    ("attention_budget_bytes=lots", "--wan-setting attention_budget_bytes expects an integer"),
    ("upsample=stock", "--wan-setting expects NAME=VALUE with NAME one of attention,"),  # KL's
])
def test_wan_setting_rejects_an_unknown_name_or_value(item, expected, capsys):
    from fast_vae_decode.fastpath.families.wan.settings import WanSettings, settings

    err = _one_line_error(capsys, ["bench", "--wan-setting", item, *QUICK])
    assert expected in err
    assert settings == WanSettings()  # nothing was changed


def test_kl_setting_takes_the_declared_values(monkeypatch):
    from fast_vae_decode.bench.cli import _apply_kl_setting
    from fast_vae_decode.fastpath.families.kl.settings import settings

    for name in ("attention", "upsample", "cudnn_benchmark", "chunked_min_tokens"):
        monkeypatch.setattr(settings, name, getattr(settings, name))  # restored after the test
    _apply_kl_setting("attention=sdpa")
    _apply_kl_setting("upsample=SUBPIXEL")
    _apply_kl_setting("cudnn_benchmark=none")
    _apply_kl_setting("chunked_min_tokens=4096")
    assert (settings.attention, settings.upsample) == ("sdpa", "subpixel")
    assert settings.cudnn_benchmark is None and settings.chunked_min_tokens == 4096


@pytest.mark.parametrize("argv, usage", [
    (["bench", "--bogus"], "usage: python -m fast_vae_decode bench "),
    (["demo", "--size", "big"], "usage: python -m fast_vae_decode demo "),
    (["report"], "usage: python -m fast_vae_decode report "),
])
def test_argparse_errors_show_the_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert err.strip().splitlines()[-1].startswith(f"{usage.split(': ', 1)[1].strip()}: error:")


def test_the_entry_point_says_a_mistake_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(REPO), "report", "--json",
                             str(tmp_path / "missing.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "no such file" in result.stderr and result.stdout == ""


# --- defaults that depend on the machine or on where files go ---------------------------------


def test_bench_without_cases_on_a_cpu_runs_the_tiny_cases(monkeypatch):
    from fast_vae_decode.bench import run as bench_run
    from fast_vae_decode.bench.cases import TINY_CASES

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_run, "run_bench", lambda options: seen.append(options) or [])
    code, text = run_cli(["bench", "--no-comfyui", "--host-malloc", "system",
                          "--triton-cache", "keep"])
    assert code == 0
    assert [c.name for c in seen[0].cases] == list(TINY_CASES) and TINY_CASES
    (said,) = [line for line in text.splitlines() if "no --cases" in line]
    assert all(name in said for name in TINY_CASES) and "GPU-sized" in said
    code, text = run_cli(["bench", "--no-comfyui", "--cases", "sdxl-1024", "--host-malloc",
                          "system", "--triton-cache", "keep"])
    assert code == 0 and [c.name for c in seen[1].cases] == ["sdxl-1024"]
    assert "no --cases" not in text


def test_demo_writes_outside_the_source_tree_by_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one help line per option: no wrapped words
    from fast_vae_decode.bench.cli import build_parser

    out = pathlib.Path(build_parser().parse_args(["demo"]).out).resolve()
    assert not out.is_relative_to(REPO.resolve()), out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert out.name in capsys.readouterr().out  # --help shows where it goes


def test_one_frame_video_cases_are_timed_like_images():
    from fast_vae_decode.bench.cases import CASES
    from fast_vae_decode.bench.run import BenchOptions, repeats_for

    options = BenchOptions(cases=[])
    assert repeats_for(CASES["sdxl-1024"], options) == 11
    assert repeats_for(CASES["qwen-1024"], options) == 11  # one latent frame: an image decode
    assert repeats_for(CASES["wan21-480p-33"], options) == 3
    assert repeats_for(CASES["qwen-1024"], BenchOptions(cases=[], repeats=5)) == 5


def test_lossless_is_measured_beside_stock_before_any_fused_decode():
    """Stock and lossless peaks compare only from one allocator state: a fused decode keeps fold
    buffers that shift the caching allocator's block rounding for every later decode (on LTX-2,
    stock measured after a fused decode peaked 0.6 MiB higher than stock before it). So the
    order is stock, lossless, high, then stock once more (the unchanged-after-install check)."""
    from fast_vae_decode.bench.cases import select_cases
    from fast_vae_decode.bench.results import CaseResult
    from fast_vae_decode.bench.run import BenchOptions, measure_subject
    from fast_vae_decode.bench.subjects import Subject

    order = []
    images = torch.zeros(1, 8, 8, 3)

    def stock():
        order.append("stock")
        return images

    def decode(quality):
        order.append(quality)
        return images, {"text": "high: 1 fused module" if quality == "high" else "lossless"}

    (case,) = select_cases("tiny-sdxl")
    subject = Subject("diffusers", torch.nn.Linear(1, 1), torch.zeros(1, 4, 1, 1),
                      torch.device("cpu"), False, stock, decode)
    options = BenchOptions(cases=[case], repeats=1, warmup=0)
    result = measure_subject(case, subject, options, CaseResult(case.name, case.arch, [1, 4, 1, 1]))
    assert order == ["stock", "lossless", "high", "high", "stock"]
    assert result.lossless_bit_exact and result.stock_bit_exact_after_install
    assert set(result.peak_extra_mib) == {"stock", "lossless", "high", "stock_after_fused"}


@pytest.mark.parametrize("choice,direct", [("jit", False), ("direct", True)])
def test_bench_triton_launch_sets_the_switch_and_records_it(tmp_path, monkeypatch, choice, direct):
    """``--triton-launch``: direct launches on or off for the run, named in the environment."""
    pytest.importorskip("diffusers")
    from fast_vae_decode.kernels.direct_launch import (
        direct_launch_unavailable_reason,
        launch_settings,
    )

    monkeypatch.setattr(launch_settings, "direct", not direct)
    recorded = "jit" if direct_launch_unavailable_reason() is not None else choice
    path = tmp_path / "launch.json"
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--paths", "high", "--triton-launch",
                       choice, "--json", str(path), "--burn-in", "0", *QUICK])
    assert code == 0 and launch_settings.direct is direct
    assert json.loads(path.read_text())["environment"]["triton_launch"].startswith(recorded)


@pytest.mark.parametrize("choice,memmove,parts,cast,recorded", [
    ("auto", None, 4, True, "copy-out: memmove in 4 parts up to 32 MiB, else torch; latent cast on the device"),
    ("pooled", False, 4, False, "copy-out: torch; latent cast on the host"),
    ("single", True, 1, True, "copy-out: one memmove; latent cast on the device"),
    ("split", True, 4, True, "copy-out: memmove in 4 parts; latent cast on the device"),
])
def test_bench_host_copies_sets_the_switches_and_records_them(tmp_path, monkeypatch, choice,
                                                              memmove, parts, cast, recorded):
    """``--host-copies``: the pixel ring's copy-out and where the latent is cast, set for the
    run (auto: the pack's defaults, untouched) and named in the report's environment."""
    pytest.importorskip("diffusers")
    from fast_vae_decode.fastpath.pixels.decode import PixelSettings, pixel_settings
    from fast_vae_decode.fastpath.pixels.finish import HostCopy, host_copy

    for field in ("memmove", "parts"):
        monkeypatch.setattr(host_copy, field, getattr(HostCopy(), field))
    monkeypatch.setattr(pixel_settings, "cast_latent_on_device", PixelSettings().cast_latent_on_device)
    path = tmp_path / "copies.json"
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--paths", "high", "--host-copies",
                       choice, "--json", str(path), "--burn-in", "0", *QUICK])
    assert code == 0
    assert (host_copy.memmove, host_copy.parts, pixel_settings.cast_latent_on_device) == (memmove, parts, cast)
    assert json.loads(path.read_text())["environment"]["host_copies"] == recorded


def test_host_bound_case_is_wan21_x33_at_a_small_size_and_not_a_default():
    """``wan21-host-33`` measures the host's cost of a Wan 2.1 x33 decode: the same decoder,
    latent channels and frames (so the same chunks, pieces and routes, none of which depends on
    H x W), at a size whose kernels take microseconds. It is asked for by name only: the
    default selection stays the full-size cases TARGETS.md measures."""
    from fast_vae_decode.bench.cases import CASES, DEFAULT_CASES, select_cases

    host, full = CASES["wan21-host-33"], CASES["wan21-480p-33"]
    assert host.arch == full.arch and host.latent_shape[:3] == full.latent_shape[:3]
    assert host.latent_shape[3] * host.latent_shape[4] * 32 < full.latent_shape[3] * full.latent_shape[4]
    assert "wan21-host-33" not in DEFAULT_CASES and not host.tiny
    assert "wan21-480p-33" in DEFAULT_CASES
    assert [c.name for c in select_cases("all")] == list(DEFAULT_CASES)
    assert [c.name for c in select_cases("wan21-host-33")] == ["wan21-host-33"]
