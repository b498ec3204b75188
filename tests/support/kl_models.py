"""Tiny seeded KL VAEs for the tests (diffusers ``AutoencoderKL``; no download), their latents
and decodes: shared by tests/fastpath/test_kl_family.py (tier 1), test_kl_family_gpu.py (tier 3)
and test_prewarm*.py. Import it after ``pytest.importorskip("diffusers")``.
"""
from __future__ import annotations

import diffusers
import torch

from fast_vae_decode.bench.models import init_weights_
from fast_vae_decode.fastpath.gate import gate_for

TINY_LATENT = (1, 4, 8, 8)  # 16x16 output through two levels: small enough for the interpreter


def _init_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded fan-in scaled normal weights, small biases, norms at 1/0 (bench.models)."""
    return init_weights_(model, seed).eval().requires_grad_(False)


def _config(latent: int = 4, blocks=(32, 64), groups: int = 8, **extra) -> dict:
    return dict(in_channels=3, out_channels=3, latent_channels=latent,
                down_block_types=("DownEncoderBlock2D",) * len(blocks),
                up_block_types=("UpDecoderBlock2D",) * len(blocks),
                block_out_channels=blocks, layers_per_block=1, norm_num_groups=groups, **extra)


def tiny_vae(seed: int = 0, **config) -> torch.nn.Module:
    return _init_(diffusers.AutoencoderKL(**_config(**config)), seed)


def _latent(shape=TINY_LATENT, seed=1, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def bf16_pair():
    """(stock, installed, latent): two copies of the tiny VAE in bf16, the second with the fast
    path installed (the routed heads take half precision only)."""
    from fast_vae_decode.fastpath.install import install_fast_path

    stock = tiny_vae().to(torch.bfloat16)
    fast = tiny_vae().to(torch.bfloat16)
    install_fast_path(fast)
    return stock, fast, _latent(dtype=torch.bfloat16)


def _decode(model, z, is_open=None):
    with torch.no_grad():
        if is_open is None:
            return model.decode(z).sample, None
        with gate_for(model).opened(is_open) as stats:
            return model.decode(z).sample, stats
