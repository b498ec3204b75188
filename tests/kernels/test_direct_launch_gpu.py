"""direct_launch on a GPU: kept compiled kernels launched straight give what Triton's dispatch
gives, bit for bit, for every kernel a full decode uses.

Tier 3 (``cuda``). The keying and the argument hand-off with stand-in kernels are tier 1, in
test_direct_launch.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import direct_launch as dl

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(dl.triton is None, reason=dl.direct_launch_unavailable_reason()
                                 or "")]


@pytest.fixture
def counted(monkeypatch):
    """How many launches went straight to a kept compiled kernel."""
    count = {"direct": 0}
    original = dl.CompiledLaunch.__call__

    def call(self, grid, device, args):
        count["direct"] += 1
        return original(self, grid, device, args)

    monkeypatch.setattr(dl.CompiledLaunch, "__call__", call)
    dl.forget_compiled_launches()
    yield count
    dl.forget_compiled_launches()


def _both_ways(fn, monkeypatch):
    monkeypatch.setattr(dl.launch_settings, "direct", False)
    dispatched = fn()
    monkeypatch.setattr(dl.launch_settings, "direct", True)
    fn()  # the first launch of each signature goes through Triton and keeps its kernel
    direct = fn()
    return dispatched, direct


def test_norm_and_add_kernels_give_the_same_bits(counted, monkeypatch):
    from fast_vae_decode.kernels.bias_residual_add import bias_residual_add_
    from fast_vae_decode.kernels.group_norm_silu import (
        add_bias_residual_group_stats_,
        group_norm_silu,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(1, 256, 96, 80, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=cl)
    res = torch.randn_like(x).contiguous(memory_format=cl)
    w, b = torch.randn(2, 256, device="cuda", generator=g).to(torch.bfloat16)

    def run():
        out = bias_residual_add_(x.clone(memory_format=cl), b, res)
        stats_of = x.clone(memory_format=cl)
        stats = add_bias_residual_group_stats_(stats_of, b, res, 32)
        return (out, stats_of, group_norm_silu(x, w, b, 32, 1e-6),
                group_norm_silu(stats_of, w, b, 32, 1e-6, stats=stats),
                group_norm_silu(x, None, None, 32, 1e-6, silu=False, input_bias=b))

    dispatched, direct = _both_ways(run, monkeypatch)
    assert counted["direct"] >= 9
    for a, d in zip(dispatched, direct, strict=True):
        assert torch.equal(a, d)


def test_a_misaligned_view_after_aligned_launches_gets_its_own_kernel(counted):
    # Same shape and dtype, pointer 2 bytes past a 16-byte boundary: reusing the aligned
    # launches' kernel (vectorised loads) would read the wrong elements or fault.
    from fast_vae_decode.kernels.bias_residual_add import bias_residual_add_

    c = 64
    base = torch.zeros(1 + 8 * 8 * c, device="cuda", dtype=torch.bfloat16)
    aligned = base[:-1].view(1, 8, 8, c).permute(0, 3, 1, 2)
    shifted = base[1:].view(1, 8, 8, c).permute(0, 3, 1, 2)
    bias = torch.arange(c, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        base.zero_()
        bias_residual_add_(aligned, bias, None)
    base.zero_()
    assert bias_residual_add_(shifted, bias, None) is shifted
    assert torch.equal(shifted[0, :, 3, 5], bias) and base[0] == 0


def test_a_full_kl_decode_gives_the_same_bits(counted, monkeypatch):
    diffusers = pytest.importorskip("diffusers")
    from fast_vae_decode.fastpath import install
    from support.kl_models import _config, _decode, _init_, _latent

    config = _config(latent=4, blocks=(128, 256, 512, 512), groups=32)
    config["layers_per_block"] = 2
    model = _init_(diffusers.AutoencoderKL(**config), 0).to("cuda", torch.bfloat16)
    install.install_fast_path(model)
    z = _latent((1, 4, 64, 64), device="cuda", dtype=torch.bfloat16)

    def run():
        out, stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {}
        return out

    dispatched, direct = _both_ways(run, monkeypatch)
    assert counted["direct"] > 50
    assert torch.equal(dispatched, direct)
