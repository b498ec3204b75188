"""Progress and Cancel on the pack's decodes, in ComfyUI's own terms (tier 2, CPU).

A multi-chunk video decode advances ComfyUI's progress bar once per finished chunk, ending at
its total; ComfyUI's Cancel (its interrupt flag) stops the decode between chunks with ComfyUI's
interrupt exception, and leaves nothing changed: the next decode of the same VAE is exact.
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui

pytestmark = [requires_comfyui, pytest.mark.comfyui]

# Five latent frames: five chunks in the per-frame loop (0.8), three in 0.33's chunked loop.
LATENT = (1, 16, 5, 4, 4)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # high runs its fused modules on the CPU


@pytest.fixture()
def vae():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return comfy_vae("wan21", seed=0, tiny=True)


class _Bars:
    """Stands in for ``comfy.utils.ProgressBar``; records every update, optionally presses
    Cancel after the first one."""

    def __init__(self, cancel_after_first: bool = False):
        self.updates: list[tuple[int, int]] = []
        self.cancel_after_first = cancel_after_first
        outer = self

        class Bar:
            def __init__(self, total, node_id=None):
                self.total = total

            def update_absolute(self, value, total=None, preview=None):
                outer.updates.append((value, total if total is not None else self.total))
                if outer.cancel_after_first and len(outer.updates) == 1:
                    import comfy.model_management as mm

                    mm.interrupt_current_processing(True)

        self.cls = Bar


def _node(pack, vae, z, quality):
    return pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality)


def _latent():
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_a_video_decode_reports_each_chunk_and_ends_at_its_total(pack, vae, monkeypatch, quality):
    import comfy.utils

    # Each of stock's decoder calls reports: the first latent frame in a call of its own.
    monkeypatch.setattr(pack_module("fastpath.families.wan.settings").settings,
                        "join_first_chunk", False)
    bars = _Bars()
    monkeypatch.setattr(comfy.utils, "ProgressBar", bars.cls)
    with torch.inference_mode():
        _node(pack, vae, _latent(), quality)
    assert len(bars.updates) >= 3, bars.updates
    done, total = bars.updates[-1]
    assert done == total, bars.updates
    assert [d for d, _ in bars.updates] == sorted(d for d, _ in bars.updates)  # never backwards


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_cancel_stops_between_chunks_and_leaves_the_vae_exact(pack, vae, monkeypatch, quality):
    import comfy.model_management as mm
    import comfy.utils

    z = _latent()
    with torch.inference_mode():
        expected = comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]
    bars = _Bars(cancel_after_first=True)
    monkeypatch.setattr(comfy.utils, "ProgressBar", bars.cls)
    with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
        _node(pack, vae, z, quality)
    assert len(bars.updates) == 1  # stopped right after the first chunk
    gate = pack_module("fastpath.gate").existing_gate(vae.first_stage_model)
    assert gate is None or not gate.is_open
    monkeypatch.setattr(comfy.utils, "ProgressBar", _Bars().cls)
    with torch.inference_mode():
        again = _node(pack, vae, z, "lossless").args[0]
        high = _node(pack, vae, z, "high")
    assert torch.equal(again, expected)
    assert high.ui["fast_vae_decode"][0]["path"] == "high", high.ui["text"]


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_an_image_decode_ends_the_bar_full(pack, monkeypatch, quality):
    """An image decode has no chunks of its own (on the CPU ComfyUI's VAE.decode runs it):
    the bar still ends at its total."""
    import comfy.utils

    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    bars = _Bars()
    monkeypatch.setattr(comfy.utils, "ProgressBar", bars.cls)
    z = torch.randn((1, 4, 4, 4), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _node(pack, comfy_vae("sdxl", seed=0, tiny=True), z, quality)
    assert bars.updates and bars.updates[-1][0] == bars.updates[-1][1], bars.updates
