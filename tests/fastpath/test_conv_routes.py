"""The conv routes (``fastpath.conv_routes``): which convs leave cuDNN, and that the fused KL and
Wan decoders take the routed op (``narrow_conv`` for the heads) and stay close to stock.

Tier 1: CPU, Triton interpreted, tiny diffusers decoders in bf16 (the routed kernels take half
precision only; fp32 decodes keep cuDNN's path, as the family tests check).
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath import conv_routes
from fast_vae_decode.fastpath.conv_routes import CUDNN, NARROW_CONV, conv_route
from fast_vae_decode.fastpath.families.kl import ops as kl_ops
from fast_vae_decode.fastpath.families.kl import settings as kl_settings
from fast_vae_decode.fastpath.families.wan import ops as wan_ops
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path

pytest.importorskip("diffusers")


@pytest.mark.parametrize("cout,kernel,op", [
    (3, (3, 3, 3), NARROW_CONV),  # Wan 2.1 head
    (12, (3, 3, 3), NARROW_CONV),  # Wan 2.2 head (before unpatchify)
    (3, (1, 3, 3), CUDNN),  # a causal head's uncached first frame: cuDNN won
    (3, (3, 3), CUDNN),  # the KL head: cuDNN won at narrow_conv's default tiling
    (16, (3, 3, 3), CUDNN),  # every wider conv stays on cuDNN
    (384, (3, 3, 3), CUDNN),
    (768, (3, 1, 1), CUDNN),  # Wan's time_conv
])
def test_route_table(cout, kernel, op):
    assert conv_route(cout, kernel) == op


class _Spy:
    def __init__(self, monkeypatch, module):
        self.calls = 0
        real = module.narrow_conv

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, "narrow_conv", counted)


def _decode(model, z, is_open):
    with torch.no_grad():
        if not is_open:
            return model.decode(z).sample
        with gate_for(model).opened(True) as stats:
            out = model.decode(z).sample
        assert stats.fallbacks == {} and stats.fused_calls > 0
        return out


def _psnr(a, b, peak=2.0):
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(peak**2 / mse)).item()


# A 2-D route the table does not have (cuDNN won there), so the KL wiring is exercised.
KL_HEAD_ROUTE = conv_routes.ConvRoute(NARROW_CONV, 3, ((3, 3),), "test")


@pytest.fixture
def kl_pair():
    from support.kl_models import bf16_pair

    return bf16_pair()


def test_kl_head_runs_narrow_conv_and_stays_close(kl_pair, monkeypatch):
    stock, fast, z = kl_pair
    monkeypatch.setattr(kl_settings.settings, "fused_head", False)  # the head on its route
    spy = _Spy(monkeypatch, kl_ops)
    monkeypatch.setattr(conv_routes, "ROUTES", (KL_HEAD_ROUTE,))
    got = _decode(fast, z, True)
    assert spy.calls == 1  # the head, once per decode
    expected = _decode(stock, z, False)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    # bf16 end to end: both round every layer; the routed head rounds once where stock rounds
    # its conv output and then the bias add.
    assert _psnr(got.float(), expected.float()) > 40  # 46 dB when written


def test_kl_without_a_route_keeps_cudnn(kl_pair, monkeypatch):
    stock, fast, z = kl_pair
    monkeypatch.setattr(kl_settings.settings, "fused_head", False)  # the head on its route
    spy = _Spy(monkeypatch, kl_ops)
    routed_off = _decode(fast, z, True)  # the table as shipped: the KL head stays on cuDNN
    assert spy.calls == 0
    monkeypatch.setattr(conv_routes, "ROUTES", (KL_HEAD_ROUTE,))
    routed = _decode(fast, z, True)
    assert spy.calls == 1
    assert _psnr(routed.float(), routed_off.float()) > 50  # one rounding apart: 60 dB


def test_kl_lossless_is_untouched(kl_pair, monkeypatch):
    stock, fast, z = kl_pair
    spy = _Spy(monkeypatch, kl_ops)
    monkeypatch.setattr(conv_routes, "ROUTES", (KL_HEAD_ROUTE,))
    with torch.no_grad(), gate_for(fast).opened(False):
        closed = fast.decode(z).sample
    assert spy.calls == 0 and torch.equal(closed, _decode(stock, z, False))


@pytest.mark.parametrize("kind,shape", [("wan21", (1, 4, 2, 4, 6)), ("wan22", (1, 8, 2, 4, 6))])
def test_wan_head_runs_narrow_conv_and_stays_close(kind, shape, monkeypatch):
    from support.wan_models import latent, tiny_wan

    stock = tiny_wan(kind).to(torch.bfloat16)
    fast = tiny_wan(kind).to(torch.bfloat16)
    install_fast_path(fast)
    z = latent(shape, dtype=torch.bfloat16)
    spy = _Spy(monkeypatch, wan_ops)
    got = _decode(fast, z, True)
    # one call per chunk after the first (whose single uncached frame stays on cuDNN)
    assert spy.calls == shape[2] - 1
    expected = _decode(stock, z, False)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    assert _psnr(got.float(), expected.float()) > 40  # 48 / 52 dB when written
    monkeypatch.setattr(conv_routes, "ROUTES", ())
    routed_off = _decode(fast, z, True)
    assert spy.calls == shape[2] - 1  # no more calls without the route
    assert _psnr(got.float(), routed_off.float()) > 55  # 65 / 66 dB


def test_wan_head_prewarm_records_both_tap_variants():
    # The first decode's warm-up compiles what the head will launch (the later chunks' three
    # temporal taps; the first chunk's single frame stays on cuDNN). Every causal conv warms up:
    # those left on cuDNN for the Triton pass that adds their bias.
    from fast_vae_decode.fastpath.families.wan.modules import FusedWanCausalConv3d
    from fast_vae_decode.kernels import implicit_gemm_conv, narrow_conv
    from fast_vae_decode.kernels.backend import recording_launches
    from support.wan_models import tiny_wan

    fast = tiny_wan("wan21").to(torch.bfloat16)
    install_fast_path(fast)
    convs = [m for m in fast.modules() if isinstance(m, FusedWanCausalConv3d)]
    assert all(m.prewarm_channels() == m.in_channels for m in convs)
    heads = [m for m in convs if m.out_channels == 3]
    assert len(heads) == 1
    with recording_launches() as recorded, torch.inference_mode():
        heads[0].prewarm(torch.device("cpu"), torch.bfloat16)
    taps = sorted(kw["KT"] for k, _, _, kw in recorded
                  if k is implicit_gemm_conv._implicit_gemm_conv_kernel)
    assert taps == [3]
    assert sum(k is narrow_conv._tap_sum_kernel for k, *_ in recorded) == 1
