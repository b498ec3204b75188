"""torch.compile of an installed decoder (as KJNodes' TorchCompileVAE does): it compiles, the
trace sees the stock graph whatever the gate says, and no eager Triton kernel runs inside it.

Dynamo's ``eager`` backend captures the graph as every backend does but runs the captured ops
unchanged, so the compiled output can be compared bit for bit with the eager lossless decode
on CI's CPUs; ``aot_eager`` (which decomposes ops, as inductor does) is compared with the same
compilation of an uninstalled copy.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fast_vae_decode.bench.models import diffusers_vae, seeded_latent
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.kernels import group_norm_silu as gns


def _compiled_decode(model, z, backend, gate_open=False):
    torch._dynamo.reset()
    compiled = torch.compile(model.decoder, backend=backend)
    latent = model.post_quant_conv(z) if model.post_quant_conv is not None else z
    with torch.no_grad(), gate_for(model).opened(gate_open):
        return compiled(latent)


@pytest.mark.parametrize("gate_open", [False, True])
def test_compiled_installed_decoder_is_stock(monkeypatch, gate_open):
    model = diffusers_vae("sdxl", seed=0, tiny=True)
    stock = copy.deepcopy(model)
    assert install_fast_path(model).installed
    z = seeded_latent((1, 4, 4, 4), seed=2)
    with torch.no_grad():
        expected = stock.decode(z).sample

    def no_kernels_in_a_trace(*args, **kwargs):
        raise AssertionError("a Triton kernel was called while torch.compile traced")

    monkeypatch.setattr(gns, "group_norm_silu", no_kernels_in_a_trace)
    assert torch.equal(_compiled_decode(model, z, "eager", gate_open), expected)
    assert torch.equal(_compiled_decode(model, z, "aot_eager", gate_open),
                       _compiled_decode(stock, z, "aot_eager"))


def test_compiled_installed_wan_decoder_traces_the_stock_convs(monkeypatch):
    """The lossless shortcuts (one-buffer causal conv input) step aside inside a trace too."""
    from fast_vae_decode.fastpath.families.wan import exact as wan_exact
    from support.wan_models import latent, tiny_wan

    model, stock = tiny_wan("wan21"), tiny_wan("wan21")
    assert install_fast_path(model).installed
    z = latent((1, 4, 1, 4, 6))

    def not_in_a_trace(*args, **kwargs):
        raise AssertionError("an exact shortcut ran while torch.compile traced")

    monkeypatch.setattr(wan_exact, "_padded_input", not_in_a_trace)
    monkeypatch.setattr(wan_exact, "rms_norm_exact", not_in_a_trace)
    torch._dynamo.reset()
    compiled = torch.compile(model.decoder, backend="eager")
    x = model.post_quant_conv(z)
    with torch.no_grad(), gate_for(model).opened(False):
        got = compiled(x[:, :, :1], feat_cache=[None] * 64, feat_idx=[0], first_chunk=True)
    with torch.no_grad():
        want = stock.decoder(stock.post_quant_conv(z)[:, :, :1], feat_cache=[None] * 64,
                             feat_idx=[0], first_chunk=True)
    assert torch.equal(got, want)
