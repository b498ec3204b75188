"""A broken fast path never loses the result (tier 1, CPU, tiny diffusers KL VAE).

When a fused kernel raises at run time, the module it ran in is disabled for the session and
says so once in the log, and the decode that hit it is re-run on the stock path: a fused
decoder that carried on around one stock block would hand back a mix of fast and stock
layers, so the node returns exactly the lossless result for that call. Later decodes skip the
broken modules without trying them again and keep the fast path everywhere else.
"""
from __future__ import annotations

import logging

import pytest
import torch

from fast_vae_decode.fastpath import quality
from fast_vae_decode.fastpath.families.kl import modules as kl_modules
from fast_vae_decode.fastpath.families.kl import ops as kl_ops
from fast_vae_decode.fastpath.gate import gate_for

pytest.importorskip("diffusers")

LATENT = (1, 4, 8, 8)  # 16x16 output through the tiny VAE's two levels: quick in the interpreter

# fp32 on the CPU, open gate vs stock: reordered sums of a few ULPs compounded over ~10 layers,
# measured ~2e-6 of the output range (see test_kl_family.py); 1e-4 still catches a wrong layer.
REL_TOL = 1e-4


@pytest.fixture()
def vae():
    from fast_vae_decode.bench.models import diffusers_vae

    return diffusers_vae("sdxl", seed=0, tiny=True)


def _latent():
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(1))


def _decode(vae, quality_name, z):
    with torch.no_grad():
        return quality.decode_at_quality(vae, quality_name, lambda: vae.decode(z).sample)


def _rel_err(a, b):
    return ((a - b).abs().max() / (b.max() - b.min())).item()


def _warnings(caplog):
    return [r for r in caplog.records
            if r.name == "fast_vae_decode" and r.levelno >= logging.WARNING]


def _break_group_norm_silu(monkeypatch, only_weight=None):
    """Make the kernel raise (for one norm's weight, or for every norm); returns the call log."""
    calls = []
    real = kl_ops.group_norm_silu

    def group_norm_silu(x, weight, bias, *args, **kwargs):
        calls.append(weight)
        if only_weight is None or weight is only_weight:
            raise RuntimeError("simulated kernel failure (group_norm_silu)")
        return real(x, weight, bias, *args, **kwargs)

    monkeypatch.setattr(kl_ops, "group_norm_silu", group_norm_silu)
    return calls


def test_one_broken_block_returns_the_exact_stock_result_then_skips_it(vae, monkeypatch, caplog):
    z = _latent()
    expected, _ = _decode(vae, "lossless", z)
    block = vae.decoder.up_blocks[1].resnets[0]
    calls = _break_group_norm_silu(monkeypatch, only_weight=block.norm1.weight)
    caplog.set_level(logging.INFO, logger="fast_vae_decode")

    out, outcome = _decode(vae, "high", z)
    assert torch.equal(out, expected)  # the call that hit the error is exactly stock
    assert outcome.path == "fallback" and "kernel error" in outcome.reason
    assert block._fvd_disabled and "simulated kernel failure" in block._fvd_disabled
    others = [m for m in vae.modules() if getattr(m, "_fvd_gate", None) is not None
              and m is not block and m is not block.norm1 and m is not block.norm2]
    assert others and not any(m._fvd_disabled for m in others)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "disabled" in warnings[0].getMessage()

    broken_calls = sum(w is block.norm1.weight for w in calls)
    out, outcome = _decode(vae, "high", z)
    assert sum(w is block.norm1.weight for w in calls) == broken_calls  # not tried again
    assert outcome.path == "high", outcome.text()
    assert "kernel error" in outcome.text()  # the UI still says why one block is stock
    assert _rel_err(out, expected) < REL_TOL
    assert len(_warnings(caplog)) == 1  # said once per session
    assert not gate_for(vae).is_open


def test_every_fused_module_broken_is_stock_now_and_later(vae, monkeypatch, caplog):
    z = _latent()
    expected, _ = _decode(vae, "lossless", z)
    _break_group_norm_silu(monkeypatch)

    def upsample_raises(*args, **kwargs):
        raise RuntimeError("simulated kernel failure (upsample)")

    # The upsample blocks use no group norm: break their folded conv too.
    monkeypatch.setattr(kl_modules, "upsample_conv_folded", upsample_raises)
    monkeypatch.setattr(kl_modules, "upsample_conv_subpixel", upsample_raises)
    caplog.set_level(logging.INFO, logger="fast_vae_decode")

    out, outcome = _decode(vae, "high", z)
    assert torch.equal(out, expected)
    assert outcome.path == "fallback" and "kernel error" in outcome.reason
    fused = [m for m in vae.modules() if getattr(m, "_fvd_gate", None) is not None
             and not isinstance(m, kl_ops.FusedGroupNormSiLU)]
    assert fused and all(m._fvd_disabled for m in fused)
    # One line per module that raised (a standalone norm too: diffusers' attention hands the
    # stock block after it a channels-last view, which the norm's own forward takes fast).
    warnings = len(_warnings(caplog))
    assert warnings == sum(1 for m in vae.modules() if getattr(m, "_fvd_disabled", None))

    out, outcome = _decode(vae, "high", z)
    assert torch.equal(out, expected)  # nothing fast is left: stock, bit for bit
    assert outcome.path == "fallback" and "kernel error" in outcome.reason
    assert len(_warnings(caplog)) == warnings


def test_a_kernel_error_inside_a_lossless_decode_cannot_happen(vae, monkeypatch):
    # The closed gate never reaches a kernel, so a broken kernel changes nothing there.
    z = _latent()
    expected, _ = _decode(vae, "lossless", z)
    calls = _break_group_norm_silu(monkeypatch)
    out, outcome = _decode(vae, "lossless", z)
    assert torch.equal(out, expected) and outcome.text() == "lossless" and not calls


def test_a_module_at_a_freed_modules_address_still_says_it_broke(vae, monkeypatch, caplog):
    """Python reuses a freed object's id(); what a module that once lived at this address said
    must not silence this one (the warning used to be keyed by id)."""
    from fast_vae_decode.fastpath import log

    z = _latent()
    block = vae.decoder.up_blocks[1].resnets[1]
    monkeypatch.setattr(log, "_SAID", set(log._SAID) | {f"broken:{id(block)}"})
    _break_group_norm_silu(monkeypatch, only_weight=block.norm1.weight)
    caplog.set_level(logging.INFO, logger="fast_vae_decode")
    _decode(vae, "high", z)
    assert block._fvd_disabled
    assert len(_warnings(caplog)) == 1
