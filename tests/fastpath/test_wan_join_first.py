"""A decode's first latent frame joined to the next chunk in one decoder call (``join_first``),
on diffusers ``AutoencoderKLWan`` (tier 1: CPU, Triton interpreted). ComfyUI's loops, 0.33's
pieces included, are in tests/comfyui/test_wan_comfy.py.

The joined call must give the stock loop's frames: the fp64 cases run every module's stock
path (the kernels take no fp64) inside the joined call structure, so they check the joining
itself to fp64 rounding; the fp32 cases run the fused modules.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fast_vae_decode.fastpath.families.wan import join_first
from fast_vae_decode.fastpath.families.wan.modules import FusedWanResample
from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path
from support.wan_models import latent, tiny_wan

# (model kind, latent shape): two frames (the joined call is the whole decode), three (a later
# call reads the caches a joined call wrote), five with odd sizes, batch 2; Wan 2.2 (residual
# up blocks whose DupUp3D shortcut drops the first chunk's first frames) with two and three.
SHAPES = [("wan21", (1, 4, 2, 4, 6)), ("wan21", (1, 4, 3, 3, 5)), ("wan21", (1, 4, 5, 3, 4)),
          ("wan21", (2, 4, 3, 4, 6)), ("wan22", (1, 8, 2, 4, 6)), ("wan22", (1, 8, 3, 3, 5))]
IDS = [f"{k}-{'x'.join(map(str, s))}" for k, s in SHAPES]


@pytest.fixture(scope="module")
def models():
    """Per kind: (stock, installed) models with the same weights."""
    out = {}
    for kind in ("wan21", "wan22"):
        model = tiny_wan(kind)
        install_fast_path(model)
        out[kind] = (tiny_wan(kind), model)
    return out


@pytest.fixture
def wan21(models):
    return models["wan21"]


@contextlib.contextmanager
def _decoder_calls(model):
    """Frames of each decoder call, appended as they come (a forward pre-hook)."""
    frames = []
    hook = model.decoder.register_forward_pre_hook(lambda m, args: frames.append(args[0].shape[2]))
    try:
        yield frames
    finally:
        hook.remove()


def _decode(model, z, *, is_open: bool, join: bool, monkeypatch):
    """``(decode, the gate's stats, frames of each decoder call)``."""
    monkeypatch.setattr(wan_settings, "join_first_chunk", join)
    monkeypatch.setattr(wan_settings, "join_per_frame", join)
    with torch.no_grad(), gate_for(model).opened(is_open) as stats, _decoder_calls(model) as calls:
        return model.decode(z).sample, stats, calls


@pytest.mark.parametrize("kind,shape", SHAPES, ids=IDS)
def test_joined_first_call_gives_the_stock_loops_frames_in_fp64(kind, shape, monkeypatch):
    stock, model = tiny_wan(kind).double(), tiny_wan(kind).double()
    install_fast_path(model)
    z = latent(shape, dtype=torch.float64)
    with torch.no_grad():
        expected = stock.decode(z).sample
    got, stats, calls = _decode(model, z, is_open=True, join=True, monkeypatch=monkeypatch)
    # One call fewer: the first two latent frames went in together.
    assert calls == [2] + [1] * (shape[2] - 2)
    assert stats.fallbacks and not stats.fused_calls  # every module ran its stock code
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind,shape", SHAPES, ids=IDS)
def test_joined_first_call_on_the_fused_modules_matches_the_unjoined_decode(models, kind, shape,
                                                                             monkeypatch):
    stock, model = models[kind]
    z = latent(shape, seed=3)
    unjoined, _, calls = _decode(model, z, is_open=True, join=False, monkeypatch=monkeypatch)
    assert calls == [1] * shape[2]
    got, stats, calls = _decode(model, z, is_open=True, join=True, monkeypatch=monkeypatch)
    assert calls == [2] + [1] * (shape[2] - 2)
    assert stats.fallbacks == {} and stats.fused_calls > 0
    # fp32: the joined convs batch more frames, which may pick other CPU conv kernels (~1e-7).
    torch.testing.assert_close(got, unjoined, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, stock.decode(z).sample, rtol=1e-4, atol=1e-4)


def test_a_temporal_upsample_in_a_joined_call_runs_as_the_first_and_second_chunk(wan21,
                                                                                  monkeypatch):
    """Each temporal upsample meets the first frame alone with an empty cache slot, then the
    other frames with the first chunk's marker: the stock loop's first two calls."""
    _, model = wan21
    seen = []
    real = FusedWanResample.fast_forward

    def spy(self, x, feat_cache=None, feat_idx=None, *args, **kwargs):
        if self.mode == "upsample3d":
            seen.append((id(self), x.shape[2], feat_cache[feat_idx[0]]))
        return real(self, x, feat_cache, feat_idx, *args, **kwargs)

    monkeypatch.setattr(FusedWanResample, "fast_forward", spy)
    _decode(model, latent((1, 4, 2, 4, 6)), is_open=True, join=True, monkeypatch=monkeypatch)
    upsamples = [m for m in model.decoder.modules() if join_first.is_temporal_upsample(m)]
    assert len(upsamples) == 2 and len(seen) == 4
    for i, m in enumerate(upsamples):
        (first_id, first_frames, first_slot), (next_id, next_frames, next_slot) = seen[2 * i:2 * i + 2]
        assert first_id == next_id == id(m)
        assert (first_frames, first_slot) == (1, None)
        assert next_slot == "Rep" and next_frames == (1 if i == 0 else 2)


def test_not_joined_with_the_gate_closed_so_lossless_stays_stock(wan21, monkeypatch):
    stock, model = wan21
    z = latent((1, 4, 3, 3, 5))
    got, _, calls = _decode(model, z, is_open=False, join=True, monkeypatch=monkeypatch)
    assert calls == [1, 1, 1]
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


def test_one_latent_frame_is_one_call_as_before(wan21, monkeypatch):
    _, model = wan21
    _, _, calls = _decode(model, latent((1, 4, 1, 4, 6)), is_open=True, join=True,
                          monkeypatch=monkeypatch)
    assert calls == [1]


def test_a_stock_temporal_upsample_declines_the_join(monkeypatch):
    """A stock Resample would skip every frame's time conv in a first call of several frames."""
    model = tiny_wan("wan21")
    install_fast_path(model)
    x = torch.zeros(1, 4, 2, 4, 6)
    monkeypatch.setattr(wan_settings, "join_first_chunk", True)
    monkeypatch.setattr(wan_settings, "join_per_frame", True)
    with gate_for(model).opened(True):
        assert join_first.join_reason(model, model.decoder, False, x) is None
        assert join_first.join_reason(model, model.decoder, True, x) == \
            "decoder without the joined pieces"
        upsample = next(m for m in model.decoder.modules() if join_first.is_temporal_upsample(m))
        object.__setattr__(upsample, "_fvd_splits_first_frame", False)
        assert join_first.join_reason(model, model.decoder, False, x) == \
            "a temporal upsample is not fused"
    assert join_first.join_reason(model, model.decoder, False, x) == "gate closed"
    monkeypatch.setattr(wan_settings, "join_first_chunk", False)
    assert join_first.join_reason(model, model.decoder, False, x) == "off"


def test_by_default_a_per_frame_loop_is_not_joined(wan21):
    """The join measured no gain in per-frame loops (``settings.join_per_frame``): by default
    only 0.33+'s chunked loop joins, so a per-frame decode keeps stock's one-frame calls."""
    _, model = wan21
    with gate_for(model).opened(True):
        assert join_first.join_reason(model, model.decoder, False, torch.zeros(1, 4, 2, 4, 6)) \
            == "a per-frame loop (join_per_frame off)"
    with torch.no_grad(), gate_for(model).opened(True), _decoder_calls(model) as calls:
        model.decode(latent((1, 4, 3, 4, 6)))
    assert calls == [1, 1, 1]


def test_where_no_kernel_runs_the_first_call_is_not_joined(monkeypatch):
    """Without Triton on the latent's device every module falls back: the decode must be stock's
    own calls (a joined call's batch shapes round differently in a CPU conv)."""
    model = tiny_wan("wan21")
    install_fast_path(model)
    monkeypatch.setattr(wan_settings, "join_first_chunk", True)
    monkeypatch.setattr(wan_settings, "join_per_frame", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with gate_for(model).opened(True):
        assert join_first.join_reason(model, model.decoder, False, torch.zeros(1, 4, 2, 4, 6)) \
            == "cpu tensor"


def test_outside_a_joined_call_a_first_frame_takes_the_stock_first_chunk_rule():
    x = torch.zeros(1, 2, 3, 2, 2)
    assert not join_first.first_in_join(x, [None], [0])
    with join_first.joined():
        assert join_first.first_in_join(x, [None], [0])
        assert not join_first.first_in_join(x, ["Rep"], [0])  # a later chunk
        assert not join_first.first_in_join(x[:, :, :1], [None], [0])  # one frame: nothing joined
        assert not join_first.first_in_join(x, None, [0])  # no cache: no chunks
    assert not join_first.joining()
