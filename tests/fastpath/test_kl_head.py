"""The KL decoders' last norm + SiLU as the head conv's prologue (``settings.fused_head``,
``ops.norm_silu_head``): taken by default on half-precision decodes, the same activation and
products as the unfused head on ``narrow_conv``, close to stock, and never on a closed gate.

Tier 1: CPU, Triton interpreted, tiny diffusers decoders in bf16 (``narrow_conv`` takes half
precision only; fp32 decodes keep the unfused head, as the family tests check).
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath import conv_routes
from fast_vae_decode.fastpath.conv_routes import NARROW_CONV
from fast_vae_decode.fastpath.families.kl import ops as kl_ops
from fast_vae_decode.fastpath.families.kl import settings as kl_settings
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.kernels import group_norm_silu as gns

pytest.importorskip("diffusers")

from support.wan_models import psnr  # noqa: E402 (after the skip: it imports diffusers lazily)

# The 2-D head on narrow_conv without the prologue (the table keeps it on cuDNN), so the fused
# head can be compared with the same conv on an unfused activation.
KL_HEAD_ROUTE = conv_routes.ConvRoute(NARROW_CONV, 3, ((3, 3),), "test")


class _Calls:
    """narrow_conv's calls (whether each had a prologue) and the norm apply passes launched."""

    def __init__(self, monkeypatch):
        self.prologues, self.applies = [], 0
        real_conv, real_launch = kl_ops.narrow_conv, gns.launch

        def conv(*args, **kwargs):
            self.prologues.append(kwargs.get("prologue") is not None)
            return real_conv(*args, **kwargs)

        def launch(kernel, *args, **kwargs):
            self.applies += kernel is gns._group_norm_apply_kernel
            return real_launch(kernel, *args, **kwargs)

        monkeypatch.setattr(kl_ops, "narrow_conv", conv)
        monkeypatch.setattr(gns, "launch", launch)


def _decode(model, z, is_open):
    with torch.no_grad(), gate_for(model).opened(is_open) as stats:
        out = model.decode(z).sample
    assert stats.fallbacks == {}
    return out


@pytest.fixture
def kl_pair():
    from support.kl_models import bf16_pair

    return bf16_pair()


def test_fused_head_is_the_default_and_skips_the_last_apply_pass(kl_pair, monkeypatch):
    stock, fast, z = kl_pair
    assert kl_settings.settings.fused_head
    calls = _Calls(monkeypatch)
    fused = _decode(fast, z, True)
    assert calls.prologues == [True]  # the head, once per decode, with the norm as prologue
    fused_applies = calls.applies
    monkeypatch.setattr(kl_settings.settings, "fused_head", False)
    monkeypatch.setattr(conv_routes, "ROUTES", (KL_HEAD_ROUTE,))
    unfused = _decode(fast, z, True)
    assert calls.prologues == [True, False]
    assert calls.applies - fused_applies == fused_applies + 1  # norm_out's apply pass is gone
    # The same rounded activation into the same packed products; only the products' fp32
    # summation order may differ (none here, under the interpreter).
    assert psnr(fused.float(), unfused.float()) > 70
    expected = _decode(stock, z, False)
    assert fused.shape == expected.shape and torch.isfinite(fused).all()
    assert psnr(fused.float(), expected.float()) > 40  # as the routed head: 46 dB when written


def test_fused_head_changes_nothing_behind_a_closed_gate(kl_pair, monkeypatch):
    stock, fast, z = kl_pair
    calls = _Calls(monkeypatch)
    with torch.no_grad(), gate_for(fast).opened(False):
        closed = fast.decode(z).sample
    assert calls.prologues == [] and torch.equal(closed, stock.decode(z).sample)


def test_fp32_decodes_keep_the_unfused_head(monkeypatch):
    # narrow_conv takes half precision only: an fp32 decode is the norm kernel then cuDNN,
    # bit for bit what it is with the setting off.
    from support.kl_models import _latent, tiny_vae

    fast = tiny_vae()
    install_fast_path(fast)
    z = _latent()
    calls = _Calls(monkeypatch)
    on = _decode(fast, z, True)
    monkeypatch.setattr(kl_settings.settings, "fused_head", False)
    off = _decode(fast, z, True)
    assert calls.prologues == [] and torch.equal(on, off)


def test_prewarm_compiles_the_fused_head():
    # The warm-up records the launches the first decode will make: pass 1 with the prologue and
    # the tap sum, besides the norm's statistics and factors.
    from fast_vae_decode.kernels import narrow_conv
    from fast_vae_decode.kernels.backend import recording_launches
    from support.kl_models import tiny_vae

    fast = tiny_vae().to(torch.bfloat16)
    install_fast_path(fast)
    with recording_launches() as launched:
        fast.decoder.prewarm(torch.device("cpu"), torch.bfloat16)
    kernels = {k for k, *_ in launched}
    assert {narrow_conv._prologue_products_kernel, narrow_conv._tap_sum_kernel,
            gns._group_norm_finalize_kernel} <= kernels
