"""``rms_norm_exact``: ComfyUI's Wan RMS norm tail in one pass, bit for bit (what lossless uses).

Tier 1 (interpreter): fp32 and fp16 against the stock formula with ``torch.equal`` (signed zeros
and NaN positions included); bf16 is declined there, because the interpreter converts fp32 to
bf16 by truncation. Install-time check: a norm that computes the formula is accepted, one that
normalizes in fp32 first (diffusers' ``WanRMS_norm``) is not. (Tier 3, every dtype at a Wan 2.1
full-resolution size on a GPU, is in test_rms_norm_exact_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.families.wan.exact import ExactRMSNorm, exact_norm_reason
from fast_vae_decode.fastpath.swap import swap_in
from fast_vae_decode.kernels.rms_norm_exact import (
    rms_norm_exact,
    rms_norm_exact_reference,
    rms_norm_exact_unsupported,
)
from support.rms_norm_exact_inputs import _inputs, _same

SHAPES = [
    (1, 96, 3, 5, 7),  # Wan 2.1's full-resolution width (not a power of two), odd spatial sizes
    (2, 12, 2, 3, 3),  # batch 2; channels not a multiple of the 4-channel tile
    (1, 384, 4, 4),  # 4-D: the attention block's per-frame norm
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_stock_formula(shape, dtype, with_bias):
    x, gamma, bias = _inputs(shape, dtype)
    bias = bias if with_bias else None
    scale = shape[1] ** 0.5
    got = rms_norm_exact(x, gamma, bias, scale)
    assert got is not None and got.dtype == x.dtype and got.is_contiguous()
    assert _same(got, rms_norm_exact_reference(x, gamma, bias, scale))


def test_declines_what_it_cannot_match():
    x, gamma, _ = _inputs((1, 8, 2, 3, 3), torch.float32)
    assert "contiguous" in rms_norm_exact_unsupported(x.transpose(3, 4), gamma, None)
    assert "gamma" in rms_norm_exact_unsupported(x, gamma[:4], None)
    if not torch.cuda.is_available():  # the interpreter: bf16 would not round like the GPU
        assert "truncation" in rms_norm_exact_unsupported(x.bfloat16(), gamma.bfloat16(), None)
    assert rms_norm_exact(x.transpose(3, 4), gamma, None, 8 ** 0.5) is None


class ComfyFormulaNorm(torch.nn.Module):
    """A channel-first RMS norm computing the formula ComfyUI's ``RMS_norm`` computes."""

    def __init__(self, dim: int):
        super().__init__()
        self.channel_first, self.scale = True, dim ** 0.5
        self.gamma = torch.nn.Parameter(torch.rand(dim, 1, 1, 1) + 0.5)
        self.bias = None

    def forward(self, x):
        return rms_norm_exact_reference(x, self.gamma, self.bias, self.scale)


class Fp32FirstNorm(ComfyFormulaNorm):
    """Normalizes in fp32 and rounds once (diffusers' ``WanRMS_norm``): other roundings."""

    def forward(self, x):
        y = torch.nn.functional.normalize(x.float(), dim=1).to(x.dtype)
        return y * self.scale * self.gamma.to(x)


def test_install_check_accepts_the_formula_and_refuses_other_roundings():
    assert exact_norm_reason(ComfyFormulaNorm(16)) is None
    assert "rounds differently" in exact_norm_reason(Fp32FirstNorm(16))
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    assert exact_norm_reason(WanRMS_norm(16, images=False)) is not None
    del diffusers


def test_swapped_norm_takes_the_kernel_and_stays_exact(monkeypatch):
    from fast_vae_decode.fastpath.families.wan import exact as wan_exact

    norm = ComfyFormulaNorm(12)
    stock = ComfyFormulaNorm(12)
    stock.load_state_dict(norm.state_dict())
    swap_in(norm, ExactRMSNorm, _fvd_exact=True)
    calls = []
    real = wan_exact.rms_norm_exact
    monkeypatch.setattr(wan_exact, "rms_norm_exact", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, _, _ = _inputs((2, 12, 2, 3, 3), torch.float32)
    with torch.no_grad():
        assert _same(norm(x), stock(x)) and calls
