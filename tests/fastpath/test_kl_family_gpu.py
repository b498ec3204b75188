"""The KL image-VAE family on diffusers ``AutoencoderKL``, full size on a GPU.

Tier 3 (``cuda``): SDXL- and Flux-architecture decoders at full width, bf16, 1024² output:
high against lossless PSNR >= 50 dB, finite. (The tiny CPU models are tier 1, in
test_kl_family.py; ComfyUI's classes are tier 2, elsewhere.)
"""
from __future__ import annotations

import math

import pytest
import torch

from fast_vae_decode.fastpath import cache, install

diffusers = pytest.importorskip("diffusers")
from support.kl_models import _config, _decode, _init_, _latent  # noqa: E402


def _psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR of ``out`` against ``ref`` with the reference's own range as the peak."""
    out, ref = out.double(), ref.double()
    mse = (out - ref).pow(2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


FULL = {
    "sdxl": dict(latent=4, blocks=(128, 256, 512, 512), groups=32),
    "flux": dict(latent=16, blocks=(128, 256, 512, 512), groups=32,
                 use_quant_conv=False, use_post_quant_conv=False),
}


@pytest.mark.cuda
@pytest.mark.parametrize("norm_input_bias", [False, True], ids=["bias-pass", "bias-in-norm"])
@pytest.mark.parametrize("arch", sorted(FULL))
def test_full_size_high_vs_lossless_psnr(arch, norm_input_bias, monkeypatch):
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings

    monkeypatch.setattr(kl_settings.settings, "norm_input_bias", norm_input_bias)
    config = _config(**FULL[arch])
    config["layers_per_block"] = 2
    model = _init_(diffusers.AutoencoderKL(**config), 0).to("cuda", torch.bfloat16)
    report = install.install_fast_path(model)
    assert report.fused == 2 + 1 + 4 * 3 + 3 + 1 and not report.skipped
    z = _latent((1, FULL[arch]["latent"], 128, 128), device="cuda", dtype=torch.bfloat16)
    lossless, _ = _decode(model, z, is_open=False)
    high, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and stats.fused_calls == report.fused
    assert torch.isfinite(high).all()
    assert high.is_contiguous() and high.shape == lossless.shape == (1, 3, 1024, 1024)
    assert _psnr(high, lossless) >= 50.0


@pytest.mark.cuda
@pytest.mark.parametrize("arch", sorted(FULL))
def test_full_size_residual_norm_stats_change_no_bit(arch, monkeypatch):
    """``residual_norm_stats`` at real sizes: the statistics handed from each resnet block's
    closing add to the next norm give the decode the setting off gives, bit for bit."""
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings

    config = _config(**FULL[arch])
    config["layers_per_block"] = 2
    model = _init_(diffusers.AutoencoderKL(**config), 0).to("cuda", torch.bfloat16)
    install.install_fast_path(model)
    z = _latent((1, FULL[arch]["latent"], 128, 128), device="cuda", dtype=torch.bfloat16)
    outs = {}
    for value in (False, True):
        monkeypatch.setattr(kl_settings.settings, "residual_norm_stats", value)
        outs[value], stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {}
    assert torch.equal(outs[True], outs[False])


@pytest.mark.cuda
@pytest.mark.parametrize("arch", sorted(FULL))
def test_full_size_graph_replay_is_the_eager_decode(arch, monkeypatch):
    """From the third high decode of a shape on, the decoder replays a CUDA graph: bit for bit
    the eager fast decode of the same latent, the same fused calls, its pool counted."""
    from fast_vae_decode.fastpath.cuda_graph import graph_bytes
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings

    config = _config(**FULL[arch])
    config["layers_per_block"] = 2
    model = _init_(diffusers.AutoencoderKL(**config), 0).to("cuda", torch.bfloat16)
    report = install.install_fast_path(model)
    shape = (1, FULL[arch]["latent"], 128, 128)
    latents = [_latent(shape, seed=s, device="cuda", dtype=torch.bfloat16) for s in (1, 2, 3)]
    monkeypatch.setattr(kl_settings.settings, "cuda_graphs", False)
    eager = [_decode(model, z, is_open=True)[0] for z in latents]
    monkeypatch.setattr(kl_settings.settings, "cuda_graphs", True)
    for i, z in enumerate(latents + latents[:1]):  # eager, capture, replay, replay
        out, stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {} and stats.fused_calls == report.fused
        assert torch.equal(out, eager[i % 3]), i
    assert graph_bytes(model) > 0
    cache.drop_fast_path_caches(model)
    assert graph_bytes(model) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("arch", sorted(FULL))
def test_full_size_padded_grid_route(arch, monkeypatch):
    """The KL padded-grid route (``padded_grid_conv``; Hopper with the optional DSL): the
    resnet convs it routes run on the DSL kernel, high stays >= 50 dB from lossless, and the
    CUDA graph captured over those launches replays the eager fast decode bit for bit."""
    from fast_vae_decode.fastpath.families.kl import ops as kl_ops
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings
    from fast_vae_decode.kernels import padded_grid_conv as pgc

    reason = pgc.dsl_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(kl_settings.settings, "padded_grid_conv", True)
    calls, real = [], kl_ops.padded_grid_conv
    monkeypatch.setattr(kl_ops, "padded_grid_conv",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    config = _config(**FULL[arch])
    config["layers_per_block"] = 2
    model = _init_(diffusers.AutoencoderKL(**config), 0).to("cuda", torch.bfloat16)
    report = install.install_fast_path(model)
    latents = [_latent((1, FULL[arch]["latent"], 128, 128), seed=s, device="cuda",
                       dtype=torch.bfloat16) for s in (1, 2)]
    monkeypatch.setattr(kl_settings.settings, "cuda_graphs", False)
    lossless, _ = _decode(model, latents[0], is_open=False)
    eager = [_decode(model, z, is_open=True)[0] for z in latents]
    assert calls  # 256² and up: every resnet conv but the 128² ones
    assert torch.isfinite(eager[0]).all() and _psnr(eager[0], lossless) >= 50.0
    monkeypatch.setattr(kl_settings.settings, "cuda_graphs", True)
    for i, z in enumerate(latents + latents):  # eager, capture, replay, replay
        out, stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {} and stats.fused_calls == report.fused
        assert torch.equal(out, eager[i % 2]), i
