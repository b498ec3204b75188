"""Tier 3: ComfyUI initialised the way its ``main.py`` does, on a GPU, in a fresh process.

That is what a user runs: in newer trees dynamic VRAM is on by default (``comfy_aimdo`` and
``ModelPatcherDynamic``), where every op fetches its weights per call. The fast path must run
fused there (no module left stock), lossless must stay ``torch.equal`` to ``VAEDecode``, and
unloading must free every fast-path cache. ``--disable-dynamic-vram`` (trees that have it) is
the legacy loader, checked the same way.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from support.comfy_env import COMFYUI_PATH, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui, pytest.mark.cuda]

PROBE = pathlib.Path(__file__).parents[1] / "support" / "comfy_main_probe.py"


def _has_dynamic_vram() -> bool:
    return "enables_dynamic_vram" in (pathlib.Path(COMFYUI_PATH) / "comfy/cli_args.py").read_text()


def _probe(arch: str, *flags: str) -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    done = subprocess.run([sys.executable, str(PROBE), COMFYUI_PATH, arch, *flags],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE "):])


@pytest.mark.parametrize("arch", ["sdxl", "wan21"])
def test_main_py_defaults_run_fused_exact_and_free_on_unload(arch):
    result = _probe(arch)
    if _has_dynamic_vram():
        assert result["dynamic"] and result["memory_mode"] == "dynamic VRAM", result
    assert result["lossless_equal"] and result["lossless_after_high_equal"], result
    assert result["lossless_after_stock_equal"], result
    # Dynamic VRAM: ComfyUI's load re-prepares every module on each call; the pack loads once
    # while nothing changes (fastpath.comfyui.loading). The legacy loader is called each time.
    assert result["pack_loads"] == (1 if result["dynamic"] else 3), result
    assert result["high_path"] == "high" and "stock calls" not in result["high_text"], result
    assert result["high_finite"] and result["psnr_vs_stock"] > 35, result
    assert result["cache_bytes_unloaded"] == 0, result
    _graph_replayed(arch, result)
    asks_patcher = "self.patcher.get_free_memory" in (pathlib.Path(COMFYUI_PATH) / "comfy/sd.py").read_text()
    assert result["batch_source"] == ("patcher" if asks_patcher else "model_management"), result
    assert result["batch_free_gib"] > 0, result


def _graph_replayed(arch: str, result: dict) -> None:
    """A KL image decoder replays a CUDA graph from its third high decode, exactly the eager
    decode's output, still after another VAE decoded (dynamic VRAM moved its weights: the graph
    reads copies, ``cuda_graph._use_copies``), and gives the graph's pool back on unload (Wan's
    first-call graphs are off by default: ``families/wan/settings.py``)."""
    assert result["high_again_equal"] == [True, True], result
    assert (result["graph_bytes_loaded"] > 0) == (arch == "sdxl"), result
    assert result["after_other_status"] == (["replayed"] if arch == "sdxl" else []), result
    assert result["high_after_other_equal"], result
    assert result["graph_bytes_unloaded"] == 0, result


def test_legacy_loader_flag_runs_fused_too():
    if not _has_dynamic_vram():
        pytest.skip("this tree has no dynamic VRAM to turn off")
    result = _probe("sdxl", "--disable-dynamic-vram")
    assert not result["dynamic"], result
    assert result["lossless_equal"] and result["high_path"] == "high", result
    assert result["pack_loads"] == 3, result
    assert "stock calls" not in result["high_text"] and result["cache_bytes_unloaded"] == 0, result
    _graph_replayed("sdxl", result)
