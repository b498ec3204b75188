"""``ExactCausalConv3d``: the lossless path of Wan's causal convs, one copy instead of cat + pad.

Tier 1 on diffusers' ``WanCausalConv3d`` (ComfyUI's ``CausalConv3d`` has the same padding logic
and is checked end to end against ``VAEDecode`` in the ComfyUI tier): the swapped conv returns
exactly the stock output for every cache shape the decoder produces, never calls ``F.pad``
or ``torch.cat`` on that path, and hands anything uncommon to the stock ``forward`` unchanged.
"""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers.models.autoencoders import autoencoder_kl_wan  # noqa: E402

from fast_vae_decode.fastpath.families.wan.exact import ExactCausalConv3d  # noqa: E402
from fast_vae_decode.fastpath.swap import swap_in  # noqa: E402

# (in, out, kernel, padding): the decoder's 3x3x3 conv, the (3, 1, 1) time conv of a temporal
# upsample (no spatial border), and a 1x1x1 shortcut (no padding at all).
CONVS = [(4, 6, 3, 1), (4, 8, (3, 1, 1), (1, 0, 0)), (4, 6, 1, 0)]
# Cached frames: none (the first chunk), one (the second chunk caches a single frame), two.
CACHES = [0, 1, 2]


def _pair(cin, cout, kernel, padding, seed=0):
    torch.manual_seed(seed)
    stock = autoencoder_kl_wan.WanCausalConv3d(cin, cout, kernel, padding=padding).eval()
    exact = autoencoder_kl_wan.WanCausalConv3d(cin, cout, kernel, padding=padding).eval()
    exact.load_state_dict(stock.state_dict())
    swap_in(exact, ExactCausalConv3d)
    return stock, exact


@pytest.fixture
def pad_and_cat_calls(monkeypatch):
    calls = []
    real_pad, real_cat = autoencoder_kl_wan.F.pad, torch.cat

    def pad(*a, **k):
        calls.append("pad")
        return real_pad(*a, **k)

    def cat(*a, **k):
        calls.append("cat")
        return real_cat(*a, **k)

    monkeypatch.setattr(autoencoder_kl_wan.F, "pad", pad)
    monkeypatch.setattr(torch, "cat", cat)
    return calls


@pytest.mark.parametrize("conv", CONVS, ids=["3x3x3", "time", "1x1x1"])
@pytest.mark.parametrize("cached", CACHES)
@pytest.mark.parametrize("batch", [1, 2])
def test_exact_path_equals_stock_without_pad_or_cat(conv, cached, batch, pad_and_cat_calls):
    stock, exact = _pair(*conv)
    x = torch.randn(batch, 4, 3, 5, 7)
    cache = torch.randn(batch, 4, cached, 5, 7) if cached else None
    with torch.no_grad():
        want = stock(x, cache)
        pad_and_cat_calls.clear()
        got = exact(x, cache)
    assert pad_and_cat_calls == []
    assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)


def test_frames_major_inputs_take_the_exact_path(pad_and_cat_calls):
    """After an upsample ComfyUI's rearrange leaves (B, C, T, H, W) in (B, T, C, H, W) memory
    order, and its cache clone keeps that order: F.pad still returns a contiguous tensor, so
    the one-buffer input (contiguous) is the same tensor and the path applies."""
    stock, exact = _pair(4, 6, 3, 1)
    x = torch.randn(1, 3, 4, 5, 7).permute(0, 2, 1, 3, 4)  # frames-major (B, C=4, T=3, H, W)
    cache = x[:, :, -2:].clone()  # preserve_format keeps the frames-major strides
    assert not x.is_contiguous() and not cache.is_contiguous()
    with torch.no_grad():
        want = stock(x, cache)
        pad_and_cat_calls.clear()
        got = exact(x, cache)
    assert pad_and_cat_calls == [] and torch.equal(got, want)


@pytest.mark.parametrize("why", ["channels_last_3d", "cache_dtype", "three_cached_frames"])
def test_uncommon_inputs_take_the_stock_forward(why, pad_and_cat_calls):
    stock, exact = _pair(4, 6, 3, 1)
    x = torch.randn(1, 4, 3, 5, 7)
    cache = torch.randn(1, 4, 2, 5, 7)
    if why == "channels_last_3d":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    elif why == "cache_dtype":
        cache = cache.double()  # torch.cat would promote: stock decides what happens
        stock, exact = stock.double(), exact.double()
        x = x.float()
    else:
        cache = torch.randn(1, 4, 3, 5, 7)  # more frames than the padding: stock crops
    with torch.no_grad():
        try:
            want = stock(x, cache)
        except RuntimeError as exc:
            with pytest.raises(type(exc)):
                exact(x, cache)
            return
        pad_and_cat_calls.clear()
        got = exact(x, cache)
    assert "pad" in pad_and_cat_calls
    assert torch.equal(got, want)
