"""Bench crops (``bench --crops / --crops-npz``) and the ``report`` command (tier 1, CPU).

One tiny bench run feeds the crop and report checks; the plot checks skip without matplotlib
(the ``report`` extra; CI installs it through ``test``). Nothing here times anything.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from test_cli import QUICK, run_cli

from fast_vae_decode.bench.cli import main
from fast_vae_decode.bench.crops import center_crop, crop_stem, load_crops
from fast_vae_decode.bench.report import command_line, report_markdown
from fast_vae_decode.bench.results import CaseResult, read_json, write_json


@pytest.fixture(scope="module")
def bench_with_crops(tmp_path_factory):
    pytest.importorskip("diffusers")
    folder = tmp_path_factory.mktemp("bench")
    paths = {"json": folder / "bench.json", "npz": folder / "crops.npz", "dir": folder / "crops"}
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--json", str(paths["json"]),
                       "--crops", str(paths["dir"]), "--crops-npz", str(paths["npz"]), *QUICK])
    assert code == 0
    return paths


def test_center_crop_takes_the_middle_frame_and_the_center():
    # Diffusers video (N C T H W, [-1, 1]): each frame filled with its index, scaled into range.
    frames = torch.arange(5.0).view(1, 1, 5, 1, 1).expand(1, 3, 5, 12, 10) / 4 * 2 - 1
    pixels, where = center_crop(frames, signed=True, video=True, size=4)
    assert pixels.shape == (4, 4, 3) and pixels.dtype == np.uint8
    assert (pixels == 128).all()  # frame 2 of 5 -> 0.5 -> 127.5 rounds to 128
    assert where["frame"] == 2 and where["box"] == [4, 3, 4, 4]
    # ComfyUI video (frames along N, [0, 1]); a crop larger than the image keeps it whole.
    comfy = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 6, 8, 3) / 2
    pixels, where = center_crop(comfy, signed=False, video=True, size=256)
    assert pixels.shape == (6, 8, 3) and (pixels == 128).all() and where["frame"] == 1
    assert crop_stem("wan21-480p-33", "bf16") == "wan21-480p-33-bf16"


def test_bench_saves_crops_as_files_and_one_npz(bench_with_crops):
    (row,) = json.loads(bench_with_crops["json"].read_text())["results"]
    crops = row["crops"]
    assert crops["lossless"] == "tiny-sdxl-lossless" and crops["high"] == "tiny-sdxl-high"
    assert crops["box"] == [0, 0, 16, 16]  # 16 px output, smaller than the crop: all of it
    assert sorted(f.name for f in bench_with_crops["dir"].iterdir()) == sorted(crops["files"])
    from_npz = load_crops(npz_path=str(bench_with_crops["npz"]))
    assert set(from_npz) == {"tiny-sdxl-lossless", "tiny-sdxl-high"}
    from_files = load_crops(folder=str(bench_with_crops["dir"]))
    for key, pixels in from_npz.items():
        assert pixels.shape == (16, 16, 3) and pixels.dtype == np.uint8
        np.testing.assert_array_equal(from_files[key], pixels)  # PNG is lossless


def _synthetic_results() -> list[CaseResult]:
    base = CaseResult("wan21-480p-33", "wan21", [1, 16, 9, 60, 104], "comfyui", None,
                      dtype="bfloat16", stock_ms=667.0, lossless_ms=650.0, high_ms=483.0,
                      lossless_speedup=1.03, high_speedup=1.38, psnr_high_vs_lossless_db=56.0,
                      high_identical_to_lossless=False, high_finite=True,
                      lossless_bit_exact=True, stock_bit_exact_after_install=True,
                      first_high_ms=900.0, first_high_overhead_ms=417.0)
    fp16 = CaseResult("wan21-480p-33", "wan21", [1, 16, 9, 60, 104], "comfyui", "fp16",
                      dtype="float16", stock_ms=700.0, lossless_ms=690.0, high_ms=577.0,
                      high_speedup_vs_base_stock=1.16, high_identical_to_lossless=True,
                      lossless_bit_exact=True)
    skipped = CaseResult("flux-1024", "flux", [1, 16, 128, 128], "comfyui", skipped="no family")
    return [base, fp16, skipped]


def test_report_markdown_lists_every_row_and_the_command():
    env = {"torch": "2.9", "gpu": "H200", "comfyui": "/opt/ComfyUI",
           "argv": ["bench", "--json", "bench.json", "--crops-npz", "crops.npz"]}
    text = report_markdown(env, _synthetic_results(), {"time": "time.png"}, {})
    assert "| wan21-480p-33 | as loaded | comfyui | bfloat16 | 667.0 |" in text
    assert "| wan21-480p-33 | fp16 |" in text and "identical" in text
    assert "| flux-1024 |" in text and "skipped: no family" in text
    assert "COMFYUI_PATH=/opt/ComfyUI python -m fast_vae_decode bench --json" in text
    assert "- GPU: `H200`" in text and "![decode time per case](time.png)" in text
    assert command_line({"argv": ["bench", "--comfyui", "/x"], "comfyui": "/x"}).startswith(
        "python -m")  # given on the command line: no environment variable in front


def test_report_writes_markdown_and_plots(bench_with_crops, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'report' extra)")
    out = tmp_path / "report"
    code, _ = run_cli(["report", "--json", str(bench_with_crops["json"]),
                       "--crops-npz", str(bench_with_crops["npz"]), "--out", str(out)])
    assert code == 0
    text = (out / "README.md").read_text()
    assert "| tiny-sdxl | as loaded | diffusers | float32 |" in text
    for name in ("time.png", "psnr.png", "crop-tiny-sdxl.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name})" in text
    assert "x 20" in text  # the difference's gain is stated in the caption


def test_bench_writes_the_report_itself(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'report' extra)")
    out = tmp_path / "report"
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--json", str(tmp_path / "b.json"),
                       "--crops-npz", str(tmp_path / "c.npz"), "--report", str(out), *QUICK])
    assert code == 0
    assert "| tiny-sdxl | as loaded |" in (out / "README.md").read_text()
    assert (out / "crop-tiny-sdxl.png").is_file() and (out / "time.png").is_file()


def test_bench_report_needs_json(tmp_path):
    code, _ = run_cli(["bench", "--cases", "tiny-sdxl", "--report", str(tmp_path), *QUICK])
    assert code == 2


def test_report_plots_precision_rows_and_skipped_cases(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'report' extra)")
    from fast_vae_decode.bench.report import write_report

    write_json(str(tmp_path / "b.json"), {"argv": ["bench"]}, _synthetic_results())
    readme = write_report(str(tmp_path / "b.json"), str(tmp_path / "out"))
    assert (tmp_path / "out" / "time.png").exists() and (tmp_path / "out" / "psnr.png").exists()
    assert "## Crops" not in readme.read_text()  # no crops were recorded
    assert read_json(str(tmp_path / "b.json"))[1][1].precision == "fp16"


def test_report_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    write_json(str(tmp_path / "b.json"), {"argv": ["bench"]}, _synthetic_results())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` fail
    code = main(["report", "--json", str(tmp_path / "b.json"), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def _tracked_state() -> str:
    """git's view of every tracked file in the checkout (empty when all are unchanged)."""
    result = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                             "--untracked-files=no"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.skip("not a git checkout")
    return result.stdout


def test_report_without_out_writes_beside_the_json_only(tmp_path, monkeypatch):
    """The committed docs/benchmark report is never the default target."""
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the 'report' extra)")
    committed = {p: p.read_bytes() for p in (REPO / "docs").rglob("*") if p.is_file()}
    before = _tracked_state()
    write_json(str(tmp_path / "small.json"), {"argv": ["bench"]}, _synthetic_results())
    monkeypatch.chdir(REPO)  # where the old default, docs/benchmark, was the committed report
    code, text = run_cli(["report", "--json", str(tmp_path / "small.json")])
    assert code == 0
    readme = tmp_path / "small-report" / "README.md"
    assert readme.is_file() and str(readme) in text
    assert "| wan21-480p-33 | as loaded |" in readme.read_text()
    assert _tracked_state() == before
    assert {p: p.read_bytes() for p in (REPO / "docs").rglob("*") if p.is_file()} == committed


def test_report_help_shows_the_default_folder(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one help line per option: no wrapped words
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "<json stem>-report/" in capsys.readouterr().out


def test_the_recorded_commit_can_be_given_by_the_caller(monkeypatch):
    """A tree copied to another machine may carry a .git whose HEAD is not its commit."""
    from fast_vae_decode.bench import run

    monkeypatch.setenv(run.COMMIT_ENV, "abc1234")
    assert run.pack_commit() == "abc1234"
    monkeypatch.delenv(run.COMMIT_ENV)
    recorded = run.pack_commit()
    assert recorded is None or recorded != "abc1234"
