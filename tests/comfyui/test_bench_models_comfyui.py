"""The bench's seeded random-weight VAEs in ComfyUI.

Tier 2 (``COMFYUI_PATH``): ComfyUI detects every architecture, full-size and tiny, from the
keys of the state dicts the builders make, and the bench runs against ComfyUI's VAEDecode.
(Seeding, the weight statistics, the diffusers builders and PSNR are tier 1, in
tests/bench/test_bench_models.py.)
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from fast_vae_decode.bench import models
from support.comfy_env import comfy_nodes, requires_comfyui

COMFY_CLASSES = {
    "sdxl": "AutoencoderKL", "sd15": "AutoencoderKL", "flux": "AutoencodingEngine",
    "wan21": "WanVAE", "wan22": "WanVAE", "ltx2": "VideoVAE",
}
# Output frames for two latent frames: Wan upsamples time 4x, LTX 8x (the first frame once).
TWO_LATENT_FRAMES = {"ltx2": 9}


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.parametrize("arch", models.ARCHS)
def test_comfyui_detects_tiny_vaes(arch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    nodes = comfy_nodes()
    vae = models.comfy_vae(arch, seed=0, tiny=True)
    assert type(vae.first_stage_model).__name__ == COMFY_CLASSES[arch]
    assert vae.latent_channels == models.latent_channels(arch)
    video = arch in models.VIDEO_ARCHS
    shape = (1, vae.latent_channels) + ((2, 4, 4) if video else (4, 4))
    with torch.inference_mode():
        images = nodes.VAEDecode().decode(vae, {"samples": models.seeded_latent(shape)})[0]
    frames = TWO_LATENT_FRAMES.get(arch, 5) if video else 1
    assert images.shape[0] == frames and images.shape[-1] == 3
    assert torch.isfinite(images).all()


@requires_comfyui
@pytest.mark.comfyui
def test_comfyui_detects_full_size_wan21():
    # The full-size builders rely on ComfyUI's detection alone (no width override); Wan 2.1 is
    # the cheapest full-size one to build on a CPU.
    comfy_nodes()
    vae = models.comfy_vae("wan21", seed=0)
    assert type(vae.first_stage_model).__module__ == "comfy.ldm.wan.vae"
    assert vae.first_stage_model.decoder.head[0].gamma.shape[0] == 96


def _bench_rows(tmp_path, monkeypatch, cases: str, precisions: str) -> list[dict]:
    """The bench's JSON rows for ``cases`` against this ComfyUI (stock path on the CPU)."""
    from fast_vae_decode.bench.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = tmp_path / "bench.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--comfyui", os.environ["COMFYUI_PATH"], "--cases", cases,
                     "--precisions", precisions, "--repeats", "1", "--warmup", "0",
                     "--triton-cache", "keep", "--json", str(path)])
    assert code == 0, out.getvalue()
    return json.loads(path.read_text())["results"]


@requires_comfyui
@pytest.mark.comfyui
def test_bench_against_comfyui_is_bit_exact(tmp_path, monkeypatch):
    rows = _bench_rows(tmp_path, monkeypatch, "tiny-sdxl,tiny-wan21", "bf16")
    assert [r["backend"] for r in rows] == ["comfyui"] * 3
    for row in rows:
        assert row["error"] is None, row
        if row["skipped"] is None:
            assert row["lossless_bit_exact"] is True, row["case"]
            assert row["stock_bit_exact_after_install"] is True, row["case"]
        # Every decode reports its progress at least once (its end); the cost is recorded.
        if row["skipped"] is None and row["precision"] is None:
            assert row["high_progress_updates"] >= 1, row["case"]
            assert row["high_progress_ms"] >= 0, row["case"]


@requires_comfyui
@pytest.mark.comfyui
def test_timed_progress_counts_the_nodes_reports_and_restores_them():
    import comfy.utils

    from fast_vae_decode.bench.progress_cost import timed_progress
    from fast_vae_decode.nodes import fast_vae_decode as node

    comfy_nodes()
    real, hook = node.comfy_progress, comfy.utils.PROGRESS_BAR_HOOK
    with timed_progress() as cost:
        report = node.comfy_progress(True)
        for done in (1, 2, 3):
            report(done, 3)
    assert cost.updates == 3 and cost.seconds >= 0
    assert node.comfy_progress is real and comfy.utils.PROGRESS_BAR_HOOK is hook


@requires_comfyui
@pytest.mark.comfyui
def test_bench_seeds_each_ltx_decode(tmp_path, monkeypatch):
    """LTX draws noise per decode: the bench seeds every decode, so lossless is comparable."""
    (row,) = _bench_rows(tmp_path, monkeypatch, "tiny-ltx2", "none")
    assert row["error"] is None and row["skipped"] is None, row
    assert row["lossless_bit_exact"] is True and row["stock_bit_exact_after_install"] is True


@requires_comfyui
@pytest.mark.comfyui
def test_interleave_runs_against_comfyui_and_restores_the_switches(tmp_path, monkeypatch):
    """``interleave`` on ComfyUI's own VAE and node (stock modules on the CPU): every variant
    decodes once per round, and the switches end as they began."""
    from fast_vae_decode.bench.cli import main
    from fast_vae_decode.fastpath.families.kl.settings import settings as kl_settings
    from fast_vae_decode.fastpath.pixels.finish import host_copy

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    comfy_nodes()  # ComfyUI set up before stdout is redirected (its log interceptor wraps it)
    before = (kl_settings.residual_norm_stats, host_copy.memmove)
    path = tmp_path / "interleave.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["interleave", "--comfyui", os.environ["COMFYUI_PATH"], "--cases",
                     "tiny-sdxl", "--rounds", "2", "--warmup", "0", "--json", str(path),
                     "--variant", "defaults=",
                     "--variant", "rns=--kl-setting residual_norm_stats=true",
                     "--variant", "pooled=--host-copies pooled"])
    assert code == 0, out.getvalue()
    data = json.loads(path.read_text())
    assert data["comfyui"] == os.environ["COMFYUI_PATH"]
    assert {v: len(t) for v, t in data["times_ms"]["tiny-sdxl"].items()} == \
        {"defaults": 2, "rns": 2, "pooled": 2}
    assert (kl_settings.residual_norm_stats, host_copy.memmove) == before


@requires_comfyui
@pytest.mark.comfyui
def test_interleave_with_stock_takes_turns_with_comfyuis_vaedecode(tmp_path, monkeypatch):
    """``interleave --stock`` on ComfyUI: VAEDecode decodes in every round beside ``high``, and
    is also timed before the pack installs anything on the VAE."""
    from fast_vae_decode.bench.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    comfy_nodes()
    path = tmp_path / "interleave.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["interleave", "--comfyui", os.environ["COMFYUI_PATH"], "--cases",
                     "tiny-sdxl", "--rounds", "2", "--warmup", "0", "--json", str(path), "--stock"])
    assert code == 0, out.getvalue()
    data = json.loads(path.read_text())
    assert {v: len(t) for v, t in data["times_ms"]["tiny-sdxl"].items()} == {"stock": 2, "high": 2}
    assert data["paths"]["tiny-sdxl"]["stock"] == ["stock"]
    assert len(data["stock_before_install_ms"]["tiny-sdxl"]) == 3
    assert "| tiny-sdxl | stock before install |" in out.getvalue()
