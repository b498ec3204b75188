"""The bench's seeded random-weight VAEs and its measurement helpers.

Tier 1 (CPU): seeding, the weight statistics the builders promise, the diffusers builders, PSNR.
(Tier 2, ComfyUI detecting every architecture from the builders' state dicts and the bench
against ComfyUI's VAEDecode, is in tests/comfyui/test_bench_models_comfyui.py.)
"""
from __future__ import annotations

import math

import pytest
import torch

from fast_vae_decode.bench import models
from fast_vae_decode.bench.timing import psnr_db, to_unit_range


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(64, 32, 3)
        self.norm = torch.nn.GroupNorm(8, 32)
        self.linear = torch.nn.Linear(256, 128)


def test_init_weights_is_seeded():
    a = models.init_weights_(_Small(), seed=3)
    b = models.init_weights_(_Small(), seed=3)
    c = models.init_weights_(_Small(), seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.startswith("norm"):
            assert not torch.equal(pa, pc), name


def test_init_weights_scales_by_fan_in_and_sets_norms():
    m = models.init_weights_(_Small(), seed=0)
    # 18 432 conv / 32 768 linear samples: the sample std is within ~1% of the true one, so
    # 5% catches a wrong fan-in (which would be off by a factor of 3 or more).
    assert m.conv.weight.std().item() == pytest.approx(1 / math.sqrt(64 * 9), rel=0.05)
    assert m.linear.weight.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert m.conv.bias.abs().max().item() < 0.1  # 0.01-scale biases: 32 draws stay below 10 sigma
    assert torch.equal(m.norm.weight, torch.ones(32))
    assert torch.equal(m.norm.bias, torch.zeros(32))


def test_arch_names():
    assert models.split_arch("tiny_wan22") == ("wan22", True)
    assert models.split_arch("flux", tiny=True) == ("flux", True)
    with pytest.raises(ValueError, match="unknown VAE architecture"):
        models.split_arch("sd3")


@pytest.mark.parametrize("arch, latent, output", [
    ("tiny_sdxl", (1, 4, 4, 4), (1, 3, 8, 8)),
    ("tiny_flux", (1, 16, 4, 4), (1, 3, 8, 8)),
    ("tiny_wan21", (1, 16, 1, 2, 2), (1, 3, 1, 16, 16)),
    ("tiny_wan22", (1, 48, 1, 2, 2), (1, 3, 1, 32, 32)),
])
def test_tiny_diffusers_vaes_decode(arch, latent, output):
    pytest.importorskip("diffusers")
    a = models.diffusers_vae(arch, seed=0)
    b = models.diffusers_vae(arch, seed=0)
    z = models.seeded_latent(latent, seed=1)
    with torch.inference_mode():
        out = a.decode(z).sample
        assert torch.equal(out, b.decode(z).sample)  # same seed, same model, same image
    assert tuple(out.shape) == output
    assert torch.isfinite(out).all()


def test_psnr():
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert psnr_db(x, x) == math.inf
    # A uniform offset of 0.01 has MSE 1e-4, i.e. 40 dB; x + 0.01 rounds to fp32 (offsets off by
    # ~1e-9 absolute, ~1e-7 relative), which moves the result by ~1e-5 dB.
    assert psnr_db(x + 0.01, x) == pytest.approx(40.0, abs=1e-3)
    assert torch.equal(to_unit_range(torch.tensor([-1.0, 0.0, 3.0]), signed=True),
                       torch.tensor([0.0, 0.5, 1.0]))
