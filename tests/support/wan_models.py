"""Tiny seeded Wan VAEs for the tests (diffusers ``AutoencoderKLWan``; no download).

Weights are diffusers' own initialisation (fan-in scaled convs) under a fixed seed, with the RMS
norm gains moved off 1 so the norms are not trivially the identity scale.
"""
from __future__ import annotations

import torch

# Wan 2.1 / Qwen-Image structure: plain up blocks, 3 output channels, attention in the middle,
# two temporal (upsample3d) and one spatial (upsample2d) resample, and a 16->32 block with a
# shortcut conv (base_dim 16, dim_mult [1, 2, 2, 2]).
WAN21 = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
             temperal_downsample=[False, True, True])
# Wan 2.2 structure: residual up blocks with DupUp3D shortcuts, 12 channels unpatchified 2x2.
WAN22 = dict(base_dim=16, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
             temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
             out_channels=12, patch_size=2, scale_factor_spatial=16)
CONFIGS = {"wan21": WAN21, "wan22": WAN22}


def tiny_wan(kind: str = "wan21", seed: int = 0, **overrides) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    config = dict(CONFIGS[kind], **overrides)
    z = config["z_dim"]
    torch.manual_seed(seed)
    model = AutoencoderKLWan(latents_mean=[0.0] * z, latents_std=[1.0] * z, **config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def latent(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = 2.0) -> float:
    """PSNR in dB of ``a`` against ``b`` for images in [-1, 1] (peak-to-peak 2)."""
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(peak**2 / mse)).item()
