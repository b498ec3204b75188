"""The Wan VAE family on diffusers ``AutoencoderKLWan`` (tier 1: CPU, Triton interpreted).

Install contracts (state dict, idempotence, fail closed), lossless == stock bit for bit (with
the preallocated decode loop in place), high close to lossless, and the frame cache surviving
a fused block that fails halfway. (Tier 3, a Wan 2.1-sized decode at 480x832 on a GPU, is in
test_wan_family_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.families.wan import modules as wan_modules
from fast_vae_decode.fastpath.families.wan import ops as wan_ops
from fast_vae_decode.fastpath.families.wan.decode import assemble_chunk_lists
from fast_vae_decode.fastpath.families.wan.modules import (
    FusedRMSNorm,
    FusedWanAttention,
    FusedWanCausalConv3d,
    FusedWanDupUp3D,
    FusedWanResample,
    FusedWanResidualBlock,
)
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.fastpath.swap import is_swapped
from support.wan_models import latent, tiny_wan


@pytest.fixture
def unjoined(monkeypatch):
    """The first latent frame in a decoder call of its own (``join_first_chunk`` off), as
    stock's loop calls it: for tests whose premise is that call (its single frame, its
    first-chunk flags) or stock's call shapes on the fused path."""
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings

    monkeypatch.setattr(wan_settings, "join_first_chunk", False)

# (model kind, latent shape)
CASES = [
    ("wan21", (1, 4, 2, 4, 6)),  # the plain case: a first chunk and one steady-state chunk
    ("wan21", (1, 4, 3, 3, 5)),  # odd latent height/width; a third chunk reads caches that a
    # steady-state chunk wrote (2-frame caches, no zero padding left)
    ("wan21", (2, 4, 2, 4, 6)),  # batch 2: a time slice of a channels-last-3d batch is not dense
    ("wan21", (1, 4, 1, 4, 6)),  # one latent frame: the decode loop returns the chunk itself
    ("wan22", (1, 8, 2, 4, 6)),  # Wan 2.2: residual up blocks, DupUp3D shortcuts, unpatchify
    ("wan22", (1, 8, 3, 3, 5)),  # Wan 2.2 with odd sizes and a third chunk
]
IDS = [f"{k}-{'x'.join(map(str, s))}" for k, s in CASES]


def stock_decode(model, z):
    """diffusers' own ``_decode`` (its cat loop), whatever is installed on ``model``."""
    stock = type(model).__dict__.get("_fvd_stock_class", type(model))
    return stock._decode(model, z).sample


@pytest.fixture(scope="module")
def models():
    """One stock and one installed model per kind (same seed, same weights)."""
    out = {}
    for kind in ("wan21", "wan22"):
        installed = tiny_wan(kind)
        out[kind] = (tiny_wan(kind), installed, install_fast_path(installed))
    return out


@pytest.mark.parametrize("kind", ["wan21", "wan22"])
def test_installs_every_decoder_module(models, kind):
    _, model, report = models[kind]
    assert report.family == "wan" and report.reason is None and report.skipped == {}
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResidualBlock

    decoder = model.decoder
    assert all(isinstance(m, FusedWanResidualBlock) for m in decoder.modules()
               if isinstance(m, WanResidualBlock))
    assert all(isinstance(m, FusedWanCausalConv3d) for m in decoder.modules()
               if isinstance(m, WanCausalConv3d))
    kinds = {type(m).__mro__[1] for m in decoder.modules() if is_swapped(m)}
    assert {FusedWanResidualBlock, FusedWanCausalConv3d, FusedWanAttention, FusedRMSNorm,
            FusedWanResample} <= kinds
    assert not any(is_swapped(m) for m in model.encoder.modules())  # the encoder stays stock
    assert model._fvd_loop is True  # diffusers' _decode is a loop this version knows


def test_state_dict_unchanged_and_install_idempotent():
    model = tiny_wan("wan21")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    report = install_fast_path(model)
    classes = [type(m) for m in model.modules()]
    assert install_fast_path(model) is report  # installs once per model
    from fast_vae_decode.fastpath.families.wan.install import install

    again = type(report)()
    install(model, gate_for(model), again)  # a second install swaps nothing more: it finds
    # the same fused modules again (rebinding them to the same gate) and every class stays
    assert again.fused == report.fused and [type(m) for m in model.modules()] == classes
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())
    model.load_state_dict(before)  # loading a checkpoint into an installed model still works


@pytest.mark.parametrize("kind,shape", CASES, ids=IDS)
def test_lossless_is_stock_bit_for_bit(models, kind, shape):
    stock, model, _ = models[kind]
    z = latent(shape)
    with torch.no_grad():
        expected = stock.decode(z).sample
        with gate_for(model).opened(False):
            got = model.decode(z).sample
    assert torch.equal(got, expected)
    assert got.stride() == expected.stride()


@pytest.mark.parametrize("kind,shape,is_open", [
    CASES[1] + (False,),  # lossless: what the lossless tests above also show, stated directly
    CASES[5] + (True,),  # fused modules inside: the loop is exact on the fast path too
], ids=[IDS[1] + "-closed", IDS[5] + "-open"])
def test_preallocated_loop_equals_cat_loop(models, kind, shape, is_open, unjoined):
    """The loop changes no value: same result as the stock cat loop on the same modules."""
    _, model, _ = models[kind]
    z = latent(shape, seed=1)
    with torch.no_grad(), gate_for(model).opened(is_open):
        assert torch.equal(model.decode(z).sample, stock_decode(model, z))


def test_assembled_chunks_take_any_chunk_sizes():
    chunks = [torch.randn(2, 3, n, 4, 5) for n in (1, 4, 4, 2, 4, 4)]  # a short chunk mid-way:
    # the preallocated plan breaks and the rest is concatenated
    got = assemble_chunk_lists(lambda i: [chunks[i]], [1] * len(chunks))
    assert torch.equal(got, torch.cat(chunks, 2)) and got.is_contiguous()


def test_a_lossless_decode_installs_and_stays_exact(models):
    """Lossless installs too (its exact shortcuts live in the installed classes); gate closed."""
    from fast_vae_decode.fastpath.install import install_report
    from fast_vae_decode.fastpath.quality import decode_at_quality

    stock = models["wan21"][0]
    fresh = tiny_wan("wan21")
    z = latent((1, 4, 2, 4, 6))
    with torch.no_grad():
        out, outcome = decode_at_quality(fresh, "lossless", lambda: fresh.decode(z).sample)
        assert torch.equal(out, stock.decode(z).sample)
    assert outcome.path == "lossless" and install_report(fresh).installed


def _high_and_stock(models, kind, shape):
    """(open-gate decode, stock decode, the open gate's stats) of one latent."""
    stock, model, _ = models[kind]
    z = latent(shape)
    with torch.no_grad():
        expected = stock.decode(z).sample
        with gate_for(model).opened(True) as stats:
            got = model.decode(z).sample
    return got, expected, stats


@pytest.mark.parametrize("kind,shape", CASES, ids=IDS)
def test_high_close_to_lossless(models, kind, shape):
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert stats.fallbacks == {} and stats.fused_calls > 0
    assert got.shape == expected.shape and torch.isfinite(got).all()
    # fp32 throughout: the fused norm sums squares in another order and the channels-last convs
    # use other CPU kernels, each ~1e-7 relative; ~15 layers deep on outputs of magnitude ~1.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_upsample_bias_is_added_by_the_packs_pass(models, kind, shape, monkeypatch):
    """The folded upsample conv runs without its bias, which ``bias_residual_add_`` adds
    channels-last (torch's broadcast add after conv_transpose2d moved a third of memory speed);
    the result stays what stock computes."""
    from fast_vae_decode.kernels import bias_residual_add as bra

    biases, added = [], []
    folded, add = wan_modules.upsample_conv_folded, bra.bias_residual_add_

    def conv(x, weight, bias):
        biases.append(bias)
        return folded(x, weight, bias)

    def kernel(out, bias, *args, **kwargs):
        added.append(out.dim() == 4 and bias is not None)
        return add(out, bias, *args, **kwargs)

    monkeypatch.setattr(wan_modules, "upsample_conv_folded", conv)
    monkeypatch.setattr("fast_vae_decode.fastpath.video_ops.bias_residual_add_", kernel)
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert biases and all(b is None for b in biases)
    assert sum(added) == len(biases)  # each upsample's frames: one 4-D bias pass
    assert stats.fallbacks == {}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [CASES[4], CASES[5]], ids=[IDS[4], IDS[5]])
def test_wan22_shortcuts_are_written_channels_last(models, kind, shape, unjoined):
    """Wan 2.2's DupUp3D shortcuts run ``dup_up_3d`` in a high decode (first chunk included:
    its leading frame is dropped) and hand the block's add a channels-last-3d tensor."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    _, model, _ = models[kind]
    shortcuts = [m for m in model.decoder.modules() if isinstance(m, DupUp3D)]
    assert shortcuts and all(isinstance(m, FusedWanDupUp3D) for m in shortcuts)
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, kwargs, out: seen.append(
        (kwargs.get("first_chunk", False), out.is_contiguous(memory_format=torch.channels_last_3d))),
        with_kwargs=True) for m in shortcuts]
    try:
        got, expected, stats = _high_and_stock(models, kind, shape)
    finally:
        for h in hooks:
            h.remove()
    assert stats.fallbacks == {}
    assert {first for first, _ in seen} == {True, False} and all(cl for _, cl in seen)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _high_per_setting(models, kind, shape, monkeypatch, setting: str, counted: str):
    """High decodes with the Wan setting ``setting`` off and on, and the calls of the ops
    function ``counted`` each made: ``({on: decode}, {on: calls}, stock decode)``."""
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings

    calls, real = [], getattr(wan_ops, counted)
    monkeypatch.setattr(wan_ops, counted, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    results, counts = {}, {}
    for on in (False, True):
        monkeypatch.setattr(wan_settings, setting, on)
        calls.clear()
        got, expected, stats = _high_and_stock(models, kind, shape)
        assert stats.fallbacks == {} and stats.fused_calls > 0
        results[on], counts[on] = got, len(calls)
    return results, counts, expected


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_high_with_per_tap_convs_close_to_lossless(models, kind, shape, monkeypatch):
    """The GPU's narrow-conv form on the CPU: every batch-1 3x3x3 conv as three per-tap parts,
    which norm2 and the residual add sum together with the conv biases (the kernels' addends)."""
    taken = []

    def always_taps(conv, inp):
        ok = inp.shape[0] == 1 and tuple(conv.kernel_size) == (3, 3, 3)
        taken.append(ok)
        return ok

    monkeypatch.setattr(wan_ops, "_as_2d_taps", always_taps)
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert any(taken) and stats.fallbacks == {} and stats.fused_calls > 0
    # As above: each tap's partial sum is one more fp32 rounding (~1e-7 relative).
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_high_with_first_chunk_convs_as_2d_close_to_lossless(models, kind, shape, monkeypatch,
                                                             unjoined):
    """The GPU's route for a first chunk's single uncached frame, forced on the CPU: every
    batch-1 3x3x3 conv over one frame runs its last temporal tap as ``conv2d``
    (``last_tap_part``); later chunks keep their route."""
    taken = []

    def one_frame(conv, inp):
        ok = inp.shape[0] == 1 and inp.shape[2] == 1 and tuple(conv.kernel_size) == (3, 3, 3)
        taken.append(ok)
        return ok

    monkeypatch.setattr(wan_ops, "_single_tap_2d", one_frame)
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert any(taken) and not all(taken) and stats.fallbacks == {} and stats.fused_calls > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4], ("wan21", (1, 4, 4, 3, 5))],
                         ids=[IDS[1], IDS[4], "wan21-4-frames"])
def test_high_with_stacked_taps_convs_close_to_lossless(models, kind, shape, monkeypatch):
    """The GPU's stacked route forced on the CPU: every batch-1 3x3x3 conv of equal widths
    (but a first chunk's single uncached frame) runs as one 2-D conv over the channel-stacked
    input its norm wrote, with the cached and zero frames copied in; the next caches are the
    norm's frame tails. Off, the same decode takes the other routes."""
    def forced(conv, x, n_prev):
        return (wan_ops.settings.stacked_taps and x.shape[0] == 1
                and conv.in_channels == conv.out_channels and wan_ops._plain_3x3x3(conv)
                and (n_prev > 0 or x.shape[2] > 1))

    monkeypatch.setattr(wan_ops, "_stacked_taps", forced)
    results, counts, expected = _high_per_setting(models, kind, shape, monkeypatch,
                                                  "stacked_taps", "stacked_parts")
    assert counts[False] == 0 and counts[True] > 0
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


def _gemm_twin(padded, packed, bias=None, residual=None, ffi=False, tiling=None):
    """The kernel's stand-in on the CPU: its GEMM twin (the calling convention, ``ffi``, has no
    effect on what it computes)."""
    from fast_vae_decode.kernels import padded_grid_conv as pgc

    return pgc.padded_grid_gemm_reference(padded, packed, bias, residual)


def _forced_padded_grid_route(conv, x, prev):
    """The padded-grid route on the CPU: every batch-1 3x3x3 conv but a lone first frame's."""
    n_prev = prev.shape[2] if isinstance(prev, torch.Tensor) else 0
    return (wan_ops.settings.padded_grid_conv and x.shape[0] == 1
            and wan_ops._plain_3x3x3(conv) and (n_prev > 0 or x.shape[2] > 1))


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4], ("wan21", (1, 4, 4, 3, 5))],
                         ids=[IDS[1], IDS[4], "wan21-4-frames"])
def test_high_with_padded_grid_convs_close_to_lossless(models, kind, shape, monkeypatch):
    """The Hopper padded-grid route forced on the CPU, its kernel stood in for by its GEMM twin
    (``padded_grid_gemm_reference``, the kernel's own layout math): every batch-1 3x3x3 conv
    but a lone first frame's reads a zero-padded grid that its norm wrote, with the cached and
    zero frames copied in; the next caches come from the grid's interior. Off, the same decode
    takes the other routes."""

    monkeypatch.setattr(wan_ops, "padded_grid_route", _forced_padded_grid_route)
    monkeypatch.setattr(wan_ops, "padded_grid_conv", _gemm_twin)
    results, counts, expected = _high_per_setting(models, kind, shape, monkeypatch,
                                                  "padded_grid_conv", "padded_grid_parts")
    assert counts[False] == 0 and counts[True] > 0
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,shape", [CASES[1], ("wan21", (1, 4, 4, 3, 5))],
                         ids=[IDS[1], "wan21-4-frames"])
def test_padded_grid_fill_assembles_the_grid_torch_assembled(models, kind, shape, monkeypatch):
    """On the padded-grid route (forced on the CPU, the GEMM twin standing in for the kernel),
    ``padded_grid_fill`` writes each grid's border, zero frames and cached frames in one pass:
    the decode is bit for bit the one torch's fills and copy assembled, and every routed conv
    took the pass."""

    monkeypatch.setattr(wan_ops, "padded_grid_route", _forced_padded_grid_route)
    monkeypatch.setattr(wan_ops, "padded_grid_conv", _gemm_twin)
    monkeypatch.setattr(wan_ops.settings, "padded_grid_conv", True)
    grids = []
    real = wan_ops.padded_causal_input
    monkeypatch.setattr(wan_ops, "padded_causal_input",
                        lambda *a: (grids.append(1), real(*a))[1])
    results, counts, _ = _high_per_setting(models, kind, shape, monkeypatch,
                                           "padded_grid_fill", "padded_grid_fill")
    assert counts[False] == 0 and counts[True] == len(grids) // 2 > 0
    assert torch.equal(results[True], results[False])


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_padded_grid_residual_epilogue_writes_the_blocks_output(models, kind, shape,
                                                                monkeypatch):
    """With ``padded_grid_residual`` on, a residual block's second conv on the padded-grid
    route (forced on the CPU, the GEMM twin standing in for the kernel) adds its bias and the
    block's input itself: the block's output is that conv's, and the decode stays what the
    other routes decode (one more bf16 rounding at most: the conv's output is rounded before
    the residual is added, as stock rounds it)."""
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings
    from fast_vae_decode.kernels import padded_grid_conv as pgc

    finished = []

    def twin(padded, packed, bias=None, residual=None, ffi=False, tiling=None):
        finished.append(residual is not None and bias is not None and bias.dtype == torch.float32)
        return pgc.padded_grid_gemm_reference(padded, packed, bias, residual)

    monkeypatch.setattr(wan_ops, "padded_grid_route", _forced_padded_grid_route)
    monkeypatch.setattr(wan_ops, "padded_grid_conv", twin)
    monkeypatch.setattr(wan_settings, "padded_grid_residual", True)
    results, counts, expected = _high_per_setting(models, kind, shape, monkeypatch,
                                                  "padded_grid_conv", "padded_grid_parts")
    assert counts[False] == 0 and any(finished) and not all(finished)
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


def test_padded_grid_tvm_ffi_setting_reaches_every_routed_conv(models, monkeypatch):
    """``padded_grid_tvm_ffi`` is how each routed conv asks the kernel to launch (TVM FFI or
    the DSL's own call): every call on the route (forced on the CPU, the GEMM twin standing in)
    carries the setting, and the decode is bit for bit the same either way."""
    asked = []

    def twin(padded, packed, bias=None, residual=None, ffi=False, tiling=None):
        asked.append(ffi)
        return _gemm_twin(padded, packed, bias, residual)

    monkeypatch.setattr(wan_ops, "padded_grid_route", _forced_padded_grid_route)
    monkeypatch.setattr(wan_ops, "padded_grid_conv", twin)
    monkeypatch.setattr(wan_ops.settings, "padded_grid_conv", True)
    kind, shape = CASES[1]
    results, counts, _ = _high_per_setting(models, kind, shape, monkeypatch,
                                           "padded_grid_tvm_ffi", "padded_grid_parts")
    assert counts[False] == counts[True] > 0
    assert asked == [False] * counts[False] + [True] * counts[True]
    assert torch.equal(results[True], results[False])


def test_padded_grid_candidate_setting_reaches_every_routed_conv(models, monkeypatch):
    """``padded_grid_candidate`` picks each routed conv's ``SWEEP_TILINGS`` candidate (the
    tiny decoder's widths standing in for the real ones): -1 asks for none, so every conv runs
    its measured tiling; 0 asks each conv for its shape's first candidate. The route is forced
    on the CPU with the GEMM twin, which computes the same whatever the tiling."""
    from fast_vae_decode.kernels import padded_grid_conv as pgc

    asked = []

    def twin(padded, packed, bias=None, residual=None, ffi=False, tiling=None):
        asked.append(tiling)
        return _gemm_twin(padded, packed, bias, residual)

    candidates = {}

    class Sweep(dict):  # every shape the route meets has a candidate of its own
        def get(self, key, default=None):
            return candidates.setdefault(key, (pgc.Tiling(128, 8, 16, 1, 2 + len(candidates)),))

    monkeypatch.setattr(pgc, "SWEEP_TILINGS", Sweep())
    monkeypatch.setattr(wan_ops, "padded_grid_route", _forced_padded_grid_route)
    monkeypatch.setattr(wan_ops, "padded_grid_conv", twin)
    monkeypatch.setattr(wan_ops.settings, "padded_grid_conv", True)
    kind, shape = CASES[1]
    monkeypatch.setattr(wan_ops.settings, "padded_grid_candidate", -1)
    own, _, stats = _high_and_stock(models, kind, shape)
    assert stats.fallbacks == {} and asked and set(asked) == {None}
    asked.clear()
    monkeypatch.setattr(wan_ops.settings, "padded_grid_candidate", 0)
    swept, _, _ = _high_and_stock(models, kind, shape)
    assert asked and None not in asked and set(asked) == {c[0] for c in candidates.values()}
    assert torch.equal(own, swept)


def test_padded_grid_route_needs_the_gpu_kernel_and_a_measured_shape():
    """Off the GPU (or without the optional DSL) the route is never taken; on it, only the
    widths ``padded_grid_conv.TILINGS`` lists."""
    conv = torch.nn.Conv3d(96, 96, 3, padding=1)
    x = torch.zeros(1, 96, 2, 4, 4, dtype=torch.bfloat16)
    assert not wan_ops.padded_grid_route(conv, x, None)


def test_padded_grid_widths_are_the_tilings_from_the_narrowest_routed(monkeypatch):
    """Only causal 3x3x3 convs with a measured tiling take the route, and none narrower than
    ``padded_grid_min_channels`` (96 channels keep their tap convs when it is 192)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings

    narrow, wide = WanCausalConv3d(96, 96, 3, padding=1), WanCausalConv3d(192, 192, 3, padding=1)
    untiled = WanCausalConv3d(160, 160, 3, padding=1)  # Wan 2.2's width: no tiling measured
    monkeypatch.setattr(wan_settings, "padded_grid_min_channels", 96)
    assert wan_ops.padded_grid_widths(narrow) and wan_ops.padded_grid_widths(wide)
    assert not wan_ops.padded_grid_widths(untiled)
    monkeypatch.setattr(wan_settings, "padded_grid_min_channels", 192)
    assert not wan_ops.padded_grid_widths(narrow) and wan_ops.padded_grid_widths(wide)


def test_stacked_input_holds_the_zero_and_cached_frames_and_declines_caches_it_cannot_tail(
        monkeypatch):
    """``stacked_input``: the buffer's slots hold the causal zeros and the cached frames where
    the conv reads them (its conv then equals conv3d of the assembled input once the new frames
    are in), and it declines where the next cache would reach into the cached frames."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from fast_vae_decode.fastpath.video_ops import CL3D
    from fast_vae_decode.kernels.stacked_taps import fill_stacked_

    monkeypatch.setattr(wan_ops, "_stacked_taps", lambda conv, x, n_prev: True)
    gen = torch.Generator().manual_seed(4)
    conv = WanCausalConv3d(6, 6, 3, padding=1)

    def video(frames):
        return torch.randn(1, 6, frames, 4, 5, generator=gen).contiguous(memory_format=CL3D)

    for n_prev, n_new, keep, own, cache_frames in [
        (0, 2, True, False, 2),  # no cache yet: two zero frames in front
        (1, 4, True, False, 2),  # the chunk after a first frame: one zero frame, one cached
        (2, 2, True, True, 2),  # ComfyUI 0.33's two-frame pieces
        (2, 1, True, True, 1),  # one new frame, caching its own frames only (OWN)
        (2, 1, False, False, None),  # nothing to cache
    ]:
        prev = video(n_prev) if n_prev else None
        x = video(n_new)
        buffer, first, cache = wan_ops.stacked_input(conv, x, prev, keep, own)
        assert first == 2 and buffer.shape == (n_new, 18, 4, 5)
        assert (cache is None) if cache_frames is None else cache.shape[2] == cache_frames
        fill_stacked_(buffer, x, first)
        with torch.no_grad():
            got = wan_ops.stacked_parts(conv, buffer)[0]
            parts = [torch.zeros(1, 6, 2 - n_prev, 4, 5)] + ([prev] if prev is not None else [])
            inp = torch.cat(parts + [x], dim=2)
            expected = torch.nn.functional.conv3d(inp, conv.weight, None, padding=(0, 1, 1))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # One new frame behind two cached under JOINED: the next cache holds a cached frame.
    assert wan_ops.stacked_input(conv, video(1), video(2), True, False) is None
    monkeypatch.setattr(wan_ops.settings, "cache_from_norm", False)
    assert wan_ops.stacked_input(conv, video(2), video(2), True, True) is None


def test_last_tap_part_is_the_conv3d_of_one_uncached_frame():
    from fast_vae_decode.fastpath.families.wan.ops import last_tap_part
    from fast_vae_decode.fastpath.video_ops import CL3D

    gen = torch.Generator().manual_seed(6)
    conv = torch.nn.Conv3d(6, 5, 3)
    x = torch.randn(1, 6, 1, 7, 9, generator=gen).contiguous(memory_format=CL3D)
    with torch.no_grad():
        got = last_tap_part(conv, x, 1, 1)
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 2, 0))  # the causal zero frames
        expected = torch.nn.functional.conv3d(padded, conv.weight, None, padding=(0, 1, 1))
    assert got.shape == expected.shape and got.is_contiguous(memory_format=CL3D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _conv(cin, cout, kernel=3, **kw):
    return torch.nn.Conv3d(cin, cout, kernel, device="meta", **kw)


# The route's bounds, each from the H200 measurements at ``SINGLE_TAP_2D_MAX_CHANNELS``.
@pytest.mark.parametrize("conv,shape,taken", [
    (_conv(384, 384), (1, 384, 1, 120, 208), True),  # Wan 2.1 480p, up stage 1
    (_conv(192, 384), (1, 192, 1, 120, 208), True),  # a block widening 192 -> 384
    (_conv(384, 384), (1, 384, 1, 128, 128), True),  # Qwen-Image's smallest frames
    (_conv(384, 384), (1, 384, 1, 60, 104), False),  # under 128²: conv3d was faster
    (_conv(512, 512), (1, 512, 1, 352, 640), False),  # Wan 2.2's widths: conv3d was faster
    (_conv(384, 384), (1, 384, 2, 120, 208), False),  # two frames: more than one tap
    (_conv(384, 384), (2, 384, 1, 120, 208), False),  # batch 2: no frames-as-batch view
    (_conv(384, 384, (1, 3, 3)), (1, 384, 1, 120, 208), False),  # not a 3x3x3 causal conv
    (_conv(384, 384, stride=(1, 2, 2)), (1, 384, 1, 120, 208), False),
])
def test_first_chunk_convs_run_as_2d_only_where_measured_faster(conv, shape, taken):
    assert wan_ops.single_tap_2d_shape(conv, shape) is taken


# The route's bounds, each from the H200 measurements at ``STACKED_TAPS_MIN_PIXELS``.
@pytest.mark.parametrize("conv,shape,n_prev,taken", [
    (_conv(384, 384), (1, 384, 2, 120, 208), 2, True),  # Wan 2.1 up stage 1, 0.8's chunks
    (_conv(384, 384), (1, 384, 4, 120, 208), 2, True),  # 0.33's pairs of latent frames
    (_conv(192, 384), (1, 192, 2, 120, 208), 2, True),  # the block widening into it
    (_conv(384, 384), (1, 384, 4, 120, 208), 0, True),  # nothing cached: two zero frames
    (_conv(384, 384), (1, 384, 1, 120, 208), 0, False),  # one uncached frame: its single tap
    (_conv(384, 384), (1, 384, 1, 60, 104), 2, False),  # conv3d was faster at 60x104
    (_conv(96, 96), (1, 96, 4, 480, 832), 2, False),  # the slots' bytes cost more than it won
    (_conv(192, 192), (1, 192, 4, 240, 416), 2, False),  # conv3d was faster
    (_conv(384, 384), (2, 384, 4, 120, 208), 2, False),  # batch 2
    (_conv(384, 384, (1, 3, 3)), (1, 384, 4, 120, 208), 2, False),  # not a 3x3x3 conv
])
def test_stacked_taps_only_where_measured_faster(conv, shape, n_prev, taken):
    assert wan_ops.stacked_taps_shape(conv, shape, n_prev) is taken


def test_first_chunk_convs_stay_conv3d_off_the_gpu():
    conv = torch.nn.Conv3d(384, 384, 3, device="meta")
    meta = torch.empty(1, 384, 1, 128, 128, device="meta")
    assert wan_ops.single_tap_2d_shape(conv, meta.shape)
    assert not wan_ops._single_tap_2d(conv, meta)  # not a CUDA tensor: cuDNN was measured


def test_block_failing_halfway_leaves_the_frame_cache_to_the_stock_path(monkeypatch):
    """A fused block that raises after its first conv must not have touched feat_cache.

    Reference: the same model with every fused block and its second conv disabled up front
    (stock blocks, the other fused modules still fast). In the failing model each block's
    conv2 raises inside the block's fast path, and again when the stock block calls that conv
    (a ``FusedWanCausalConv3d``, which then falls back too). If either had stored a cache
    entry or advanced feat_idx before failing, the stock re-run would read the wrong frames.
    """
    z = latent((1, 4, 3, 3, 5), seed=2)
    reference = tiny_wan("wan21")
    install_fast_path(reference)
    for m in reference.modules():
        if isinstance(m, FusedWanResidualBlock):
            m._fvd_disabled = m.conv2._fvd_disabled = "test"
    with torch.no_grad(), gate_for(reference).opened(True):
        expected = reference.decode(z).sample

    model = tiny_wan("wan21")
    install_fast_path(model)
    second_convs = {id(m.conv2) for m in model.modules() if isinstance(m, FusedWanResidualBlock)}

    def failing_for_second_convs(real):
        def call(conv, *args, **kwargs):
            if id(conv) in second_convs:  # a block's conv2: conv1 has made its new cache already
                raise RuntimeError("injected")
            return real(conv, *args, **kwargs)
        return call

    # The block runs its convs through ops.conv_parts (``norm_causal_conv``); a conv module's
    # own fast path, causal_conv3d.
    for room, name in ((wan_ops, "conv_parts"), (wan_modules, "causal_conv3d")):
        monkeypatch.setattr(room, name, failing_for_second_convs(getattr(room, name)))
    with torch.no_grad(), gate_for(model).opened(True) as stats:
        got = model.decode(z).sample
    assert any("kernel error" in r for r in stats.fallbacks)
    assert torch.equal(got, expected)


# Frames: 5 uses all three taps; 2 and 1 are a decode's first chunks, whose missing front frames
# are implicit zeros (only the taps that meet real frames run).
@pytest.mark.parametrize("three", [False, True], ids=["two-parts", "three-parts"])
@pytest.mark.parametrize("frames", [5, 2, 1])
def test_conv3d_as_2d_taps_equals_conv3d(frames, three, monkeypatch):
    """The per-temporal-tap form used for narrow convs on the GPU, checked here on the CPU."""
    from fast_vae_decode.fastpath.families.wan.ops import tap_parts
    from fast_vae_decode.fastpath.video_ops import CL3D, sum_parts

    monkeypatch.setattr(wan_ops.settings, "three_tap_parts", three)
    gen = torch.Generator().manual_seed(4)
    conv = torch.nn.Conv3d(6, 5, 3)
    x = torch.randn(1, 6, frames, 7, 9, generator=gen).contiguous(memory_format=CL3D)
    with torch.no_grad():
        parts = tap_parts(conv, x, 1, 1)
        assert all(p.is_contiguous(memory_format=CL3D) for p in parts)  # what the kernels take
        # Peak memory: two full-size partial outputs alive at once unless the setting allows
        # three (one per tap that meets a real frame).
        assert len(parts) == min(3 if three else 2, frames)
        got = sum_parts(parts, conv.bias)
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, max(0, 3 - frames), 0))
        expected = torch.nn.functional.conv3d(padded, conv.weight, conv.bias, padding=(0, 1, 1))
    # fp32: partial sums added instead of one accumulation (~1e-7 relative).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_three_tap_parts_reach_the_norm_as_two_addends(models, kind, shape, monkeypatch):
    """``three_tap_parts`` with the 2-D taps forced on the CPU: the norms after the tap convs
    fold all three tap outputs (two addends, where two parts gave them one), and the decode
    stays the stock sums up to the taps' roundings."""
    monkeypatch.setattr(wan_ops, "_as_2d_taps", lambda conv, inp: (
        inp.shape[0] == 1 and tuple(conv.kernel_size) == (3, 3, 3)))
    widest, real = {False: 0, True: 0}, wan_ops.rms_norm_silu

    def norm(*args, addends=(), **kwargs):
        on = wan_ops.settings.three_tap_parts
        widest[on] = max(widest[on], len(addends))
        return real(*args, addends=addends, **kwargs)

    monkeypatch.setattr(wan_ops, "rms_norm_silu", norm)
    results, counts, expected = _high_per_setting(models, kind, shape, monkeypatch,
                                                  "three_tap_parts", "tap_parts")
    assert counts[False] > 0 and widest == {False: 1, True: 2}
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


def test_split_tap_parts_are_the_assembled_inputs_tap_parts(monkeypatch):
    """Two cached frames read where they lie and two new frames (ComfyUI 0.33's steady pieces)
    with ``three_parts_in_pieces`` off: the middle tap added into tap 0's output, the same two
    parts ``tap_parts`` makes (``three_tap_parts`` off) of the buffer ``causal_input`` would
    assemble."""
    from fast_vae_decode.fastpath.families.wan.ops import split_tap_parts, tap_parts
    from fast_vae_decode.fastpath.video_ops import CL3D, sum_parts

    monkeypatch.setattr(wan_ops.settings, "three_tap_parts", False)
    monkeypatch.setattr(wan_ops.settings, "three_parts_in_pieces", False)
    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv3d(6, 5, 3)
    prev, new = (torch.randn(1, 6, 2, 7, 9, generator=gen).contiguous(memory_format=CL3D)
                 for _ in range(2))
    with torch.no_grad():
        got = split_tap_parts(conv, prev, new, 1, 1)
        expected = tap_parts(conv, torch.cat([prev, new], 2).contiguous(memory_format=CL3D), 1, 1)
        assert [p.shape for p in got] == [p.shape for p in expected]
        assert all(p.is_contiguous(memory_format=CL3D) for p in got)  # what the kernels take
        for a, b in zip(got, expected, strict=True):
            # The same sums in the same order; the middle tap runs as two 1-frame convs.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        reference = torch.nn.functional.conv3d(torch.cat([prev, new], 2), conv.weight, conv.bias,
                                               padding=(0, 1, 1))
        torch.testing.assert_close(sum_parts(got, conv.bias), reference, rtol=1e-5, atol=1e-5)


# 4: ComfyUI 0.8's chunks; 3 and 5: odd runs; 2: 0.33's pieces with ``three_parts_in_pieces``.
@pytest.mark.parametrize("n_new", [2, 3, 4, 5])
@pytest.mark.parametrize("three", [True, False], ids=["three-parts", "taps-0-1-summed"])
def test_split_tap_parts_of_a_long_chunk_are_the_assembled_inputs_tap_parts(n_new, three,
                                                                            monkeypatch):
    """New frames behind the cached ones, one part per tap: taps 0 and 1 each read a run that
    straddles the cached and the new frames (convs written into one part), and the parts are
    those ``tap_parts`` makes of the assembled buffer, with either ``three_tap_parts``."""
    from fast_vae_decode.fastpath.families.wan.ops import split_tap_parts, tap_parts
    from fast_vae_decode.fastpath.video_ops import CL3D, sum_parts

    monkeypatch.setattr(wan_ops.settings, "three_tap_parts", three)
    monkeypatch.setattr(wan_ops.settings, "three_parts_in_pieces", True)
    gen = torch.Generator().manual_seed(6)
    conv = torch.nn.Conv3d(6, 5, 3)
    prev, new = (torch.randn(1, 6, t, 7, 9, generator=gen).contiguous(memory_format=CL3D)
                 for t in (2, n_new))
    joined = torch.cat([prev, new], 2).contiguous(memory_format=CL3D)
    with torch.no_grad():
        got = split_tap_parts(conv, prev, new, 1, 1)
        expected = tap_parts(conv, joined, 1, 1)
        assert [p.shape for p in got] == [p.shape for p in expected]
        assert len(got) == (3 if three else 2)
        assert all(p.is_contiguous(memory_format=CL3D) for p in got)  # what the kernels take
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        reference = torch.nn.functional.conv3d(joined, conv.weight, conv.bias, padding=(0, 1, 1))
        torch.testing.assert_close(sum_parts(got, conv.bias), reference, rtol=1e-5, atol=1e-5)


# Four latent frames: the third chunk is the first whose blocks meet two new frames behind two
# cached ones (the second chunk's cache follows a single frame), the fourth reads the caches the
# third left as its new frames.
@pytest.mark.parametrize("kind,shape", [("wan21", (1, 4, 4, 3, 5)), ("wan22", (1, 8, 4, 3, 5))],
                         ids=["wan21-4-frames", "wan22-4-frames"])
def test_blocks_reading_cached_frames_in_place_decode_the_assembled_sums(models, kind, shape,
                                                                          monkeypatch):
    """``split_cached_frames`` with the 2-D taps forced on the CPU: the blocks whose convs meet
    two new frames behind two cached ones read those in place and cache their new frames as
    they are, and the decode equals the one through assembled inputs."""
    monkeypatch.setattr(wan_ops, "_as_2d_taps", lambda conv, inp: (
        inp.shape[0] == 1 and tuple(conv.kernel_size) == (3, 3, 3)))
    results, counts, expected = _high_per_setting(models, kind, shape, monkeypatch,
                                                  "split_cached_frames", "split_tap_parts")
    assert counts[False] == 0 and counts[True] > 0
    # fp32: the middle tap's 1-frame convs may round apart from the 2-frame one by an ulp,
    # which the later layers carry to ~1e-6.
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


def test_long_chunks_read_their_cached_frames_in_place(models, monkeypatch):
    """``split_long_chunks`` with the 2-D taps forced on the CPU: in a per-frame loop (0.8's,
    diffusers') the full-resolution blocks meet four new frames behind two cached ones, read
    those in place and cache the last two new ones (the norm's tail); the decode equals the
    one through assembled inputs."""
    monkeypatch.setattr(wan_ops, "_as_2d_taps", lambda conv, inp: (
        inp.shape[0] == 1 and tuple(conv.kernel_size) == (3, 3, 3)))
    long_chunks, real = [], wan_ops.split_tap_parts
    monkeypatch.setattr(wan_ops, "split_tap_parts", lambda conv, prev, new, *pad: (
        long_chunks.append(new.shape[2] > 2), real(conv, prev, new, *pad))[1])
    results, counts, expected = _high_per_setting(models, "wan21", (1, 4, 3, 3, 5), monkeypatch,
                                                  "split_long_chunks", "causal_input")
    assert any(long_chunks) and counts[True] < counts[False]  # fewer assembled inputs
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True], expected, rtol=1e-4, atol=1e-4)


def test_cached_frames_stay_assembled_where_they_cannot_be_read_in_place(monkeypatch):
    """``split_input_frames`` declines (None: the buffer path) for every input it does not
    cover, and hands back an empty channels-last-3d tensor shaped like the new frames else."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from fast_vae_decode.fastpath.families.wan.ops import split_input_frames
    from fast_vae_decode.fastpath.video_ops import CL3D

    monkeypatch.setattr(wan_ops, "_as_2d_taps", lambda conv, inp: inp.shape[0] == 1)
    conv = WanCausalConv3d(6, 32, 3, padding=1)  # 32 outputs: cuDNN's, not narrow_conv's

    def video(frames, batch=1, channels=6, fmt=CL3D, dtype=torch.float32):
        return torch.randn(batch, channels, frames, 4, 5, dtype=dtype).contiguous(memory_format=fmt)

    new = split_input_frames(conv, video(2), video(2))
    assert new.shape == (1, 6, 2, 4, 5) and new.is_contiguous(memory_format=CL3D)
    new = split_input_frames(conv, video(4), video(2))  # ComfyUI 0.8's four-frame chunks
    assert new.shape == (1, 6, 4, 4, 5) and new.is_contiguous(memory_format=CL3D)
    head = WanCausalConv3d(6, 3, 3, padding=1)  # a 3-channel head conv runs narrow_conv
    assert split_input_frames(head, video(2), video(2)) is None
    for x, prev in [
        (video(2), None),  # the first chunk's blocks: nothing cached
        (video(2), video(1)),  # the chunk after the first frame: one cached frame, a zero frame
        (video(1), video(2)),  # one new frame: the next cache reaches into the cached frames
        (video(2, batch=2), video(2, batch=2)),  # batch 2: not the 2-D taps route
        (video(2), video(2, fmt=torch.contiguous_format)),  # a stock chunk's cache
        (video(2), video(2, dtype=torch.float64)),
        (video(2), video(2, channels=3)),
    ]:
        assert split_input_frames(conv, x, prev) is None
    monkeypatch.setattr(wan_ops.settings, "split_long_chunks", False)
    assert split_input_frames(conv, video(4), video(2)) is None
    assert split_input_frames(conv, video(2), video(2)) is not None
    monkeypatch.setattr(wan_ops.settings, "split_cached_frames", False)
    assert split_input_frames(conv, video(2), video(2)) is None


def test_cpu_without_interpreter_takes_the_exact_stock_path(models, monkeypatch):
    stock, model, _ = models["wan21"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    z = latent((1, 4, 2, 4, 6), seed=3)
    with torch.no_grad():
        with gate_for(model).opened(True) as stats:
            got = model.decode(z).sample
        assert torch.equal(got, stock.decode(z).sample)
    assert stats.fused_calls == 0 and "cpu tensor" in stats.fallbacks


def test_weights_cast_per_call_leave_that_block_stock():
    """ComfyUI low-VRAM mode flags a conv ``comfy_cast_weights``: its block runs stock."""
    model = tiny_wan("wan21")
    install_fast_path(model)
    block = model.decoder.up_blocks[0].resnets[0]
    block.conv1.comfy_cast_weights = True
    z = latent((1, 4, 1, 4, 6))
    with torch.no_grad(), gate_for(model).opened(True) as stats:
        model.decode(z)
    assert stats.fallbacks.get("weights cast per call (ComfyUI low-VRAM mode)", 0) >= 1
    assert block._fvd_disabled is None  # a per-call reason, not a broken module


def test_autograd_takes_the_stock_path():
    model = tiny_wan("wan21")
    install_fast_path(model)
    z = latent((1, 4, 1, 4, 6))
    with gate_for(model).opened(True) as stats:
        model.decode(z).sample.sum().backward()
    assert stats.fused_calls == 0 and any("autograd" in r for r in stats.fallbacks)


def test_unknown_decoder_module_fails_closed():
    class Custom(torch.nn.Module):  # a module the family has never seen
        def forward(self, x, *args, **kwargs):
            return x

    model = tiny_wan("wan21")
    model.decoder.up_blocks[0].add_module("extra", Custom())
    report = install_fast_path(model)
    assert report.fused == 0 and report.reason.startswith("unknown module")
    assert not any(is_swapped(m) for m in model.modules())


def test_block_that_differs_is_left_stock():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    model = tiny_wan("wan21")
    block = model.decoder.up_blocks[1].resnets[0]
    block.conv1 = WanCausalConv3d(block.in_dim, block.out_dim, (1, 3, 3), padding=(0, 1, 1))
    report = install_fast_path(model)
    assert report.skipped == {"decoder.up_blocks.1.resnets.0": "temporal kernel 1"}
    assert not is_swapped(model.decoder.up_blocks[1].resnets[0])
    assert is_swapped(model.decoder.up_blocks[1].resnets[1])


def test_wan22_shortcuts_of_other_factors_warm_up_apart(models):
    """Shortcuts have no parameters: their warm-up key carries the channels and factors that
    pick the kernel variant, so each distinct shortcut gets its own warm-up launch."""
    _, model, _ = models["wan22"]
    shortcuts = [m for m in model.decoder.modules() if isinstance(m, FusedWanDupUp3D)]
    configs = {(m.in_channels, m.out_channels, m.factor_t, m.factor_s) for m in shortcuts}
    assert len(configs) > 1  # the tiny Wan 2.2 has temporal and spatial-only up-blocks
    assert len({m.prewarm_key() for m in shortcuts}) == len(configs)


@pytest.mark.parametrize("mode, max_tokens, chunked", [
    ("chunked", 8192, True),
    ("sdpa", 8192, False),
    ("auto", 8192, True),  # the tiny frames are below the threshold
    ("auto", 1, False),  # ... and above this one: Qwen-Image's 1024² frames go to SDPA
])
@pytest.mark.parametrize("kind,shape", [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_attention_modes_stay_close_to_lossless(models, kind, shape, mode, max_tokens, chunked,
                                                monkeypatch):
    """The mid-block attention by chunks (GEMMs + the in-place row softmax, scale 1/sqrt(c) in
    the softmax) or by torch SDPA, or "auto" (the default) choosing by the frame's tokens:
    each as close to stock as the default test holds it, and chunks really go through
    ``attention_chunked``."""
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings

    calls = []
    real = wan_modules.attention_chunked
    monkeypatch.setattr(wan_modules, "attention_chunked",
                        lambda *a, **k: (calls.append(k["scale"]), real(*a, **k))[1])
    monkeypatch.setattr(wan_settings, "attention", mode)
    monkeypatch.setattr(wan_settings, "chunked_max_tokens", max_tokens)
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert stats.fallbacks == {} and stats.fused_calls > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # as test_high_close_to_lossless
    channels = {m.norm.gamma.shape[0] for m in models[kind][1].modules()
                if isinstance(m, FusedWanAttention)}
    assert (calls != []) == chunked
    assert set(calls) <= {c ** -0.5 for c in channels}


@pytest.mark.parametrize("kind,shape", [CASES[1], CASES[2], CASES[5]], ids=[IDS[1], IDS[2], IDS[5]])
def test_caches_written_by_the_norms_are_the_cloned_bytes(models, kind, shape, monkeypatch):
    """``cache_from_norm``: the residual blocks' norms write the frames their convs cache (the
    frame tail) instead of ``next_cache`` cloning them; the decode is the same bytes either
    way, and the clones really go (only single-frame chunks, whose cache reaches into the
    cached frames in front, still clone)."""
    results, counts, _ = _high_per_setting(models, kind, shape, monkeypatch, "cache_from_norm",
                                           "next_cache")
    assert torch.equal(results[True], results[False])
    assert 0 < counts[True] < counts[False]


def test_cache_tail_is_the_new_frames_next_cache_would_clone():
    from fast_vae_decode.fastpath.families.wan.ops import cache_tail, next_cache

    def buffer(frames):
        return torch.randn(1, 8, frames, 3, 4).contiguous(memory_format=torch.channels_last_3d)

    # (frames in the buffer, zero frames in front, new frames, OWN rule, tail frames or None)
    for total, zeros, new, own, expected in [
        (6, 0, 4, False, 2),  # a steady chunk of four: its last two frames
        (4, 0, 2, False, 2),  # two new frames behind two cached ones: both new frames
        (3, 2, 1, False, 1),  # the first single frame behind zero padding: itself
        (3, 0, 1, False, None),  # one new frame behind cached ones: the cache reaches back
        (3, 0, 1, True, 1),  # ... unless the block caches its own frames only (OWN)
    ]:
        inp = buffer(total)
        view = inp[:, :, total - new:]
        tail = cache_tail(inp, zeros, view, own)
        cloned = next_cache(inp, zeros, new if own else None)
        if expected is None:
            assert tail is None
            continue
        assert tail.shape == cloned.shape and tail.shape[2] == expected
        assert tail.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("kind,shape", [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_head_norm_applies_the_silu_after_it(models, kind, shape, monkeypatch):
    """The head's SiLU runs inside the fused norm's kernel: with the gate open the stock SiLU
    never runs and the decode stays close; closed, it runs as stock (lossless bit-exact)."""
    from fast_vae_decode.fastpath.families.wan.install import head_norms, head_silu
    from fast_vae_decode.fastpath.families.wan.modules import SiLUAfterNorm

    stock, model, _ = models[kind]
    norm, silu = head_norms(model.decoder)[0], head_silu(model.decoder)
    assert isinstance(silu, SiLUAfterNorm) and norm._fvd_silu
    ran = []
    real = torch.nn.SiLU.forward
    monkeypatch.setattr(torch.nn.SiLU, "forward", lambda self, x: (ran.append(self), real(self, x))[1])
    got, expected, stats = _high_and_stock(models, kind, shape)
    assert stats.fallbacks == {} and silu not in ran
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    ran.clear()
    z = latent(shape)
    with torch.no_grad(), gate_for(model).opened(False):
        assert torch.equal(model.decode(z).sample, stock.decode(z).sample)
    assert silu in ran


def test_head_silu_applies_itself_after_a_norm_that_fell_back(models):
    """A head norm on its stock path marks nothing: the SiLU after it is applied as stock."""
    from fast_vae_decode.fastpath.families.wan.install import head_norms

    stock, model, _ = models["wan21"]
    norm = head_norms(model.decoder)[0]
    z = latent((1, 4, 2, 4, 6))
    norm._fvd_disabled = "test"
    try:
        with torch.no_grad(), gate_for(model).opened(True) as stats:
            got = model.decode(z).sample
    finally:
        del norm._fvd_disabled
    assert stats.fallbacks
    with torch.no_grad():
        torch.testing.assert_close(got, stock.decode(z).sample, rtol=1e-4, atol=1e-4)
