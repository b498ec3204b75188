"""The KL image-VAE family on diffusers ``AutoencoderKL`` / ``AutoencoderKLFlux2``.

Tier 1 (CPU): tiny models from small configs with seeded random weights; the fast path runs
under TRITON_INTERPRET. Install contracts (state dict, idempotence, closed gate bit-exact), the
open gate close to lossless, fail-closed per module and per call, the fold caches, and
``load_state_dict`` into an installed model. (Tier 3, SDXL- and Flux-architecture decoders at
full width on a GPU, is in test_kl_family_gpu.py; ComfyUI's classes are tier 2, elsewhere.)
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fast_vae_decode.fastpath import cache, install
from fast_vae_decode.fastpath.families.kl import install as kl
from fast_vae_decode.fastpath.families.kl import modules as kl_modules
from fast_vae_decode.fastpath.families.kl import ops as kl_ops
from fast_vae_decode.fastpath.families.kl import settings as kl_settings
from fast_vae_decode.fastpath.families.kl.exp_scores_guard import (
    ExpScoresGuard,
    exp_scores_guard,
)
from fast_vae_decode.fastpath.families.kl.ops import FusedGroupNormSiLU
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.kernels import accepts as accepts_module
from fast_vae_decode.kernels import group_norm_silu as group_norm_silu_module
from fast_vae_decode.kernels.group_norm_silu import group_norm_silu_unsupported

diffusers = pytest.importorskip("diffusers")
from support.kl_models import _config, _decode, _init_, _latent, tiny_vae  # noqa: E402

# fp32 on the CPU, open gate vs stock: the fast path reorders sums (Welford statistics split
# over programs, folded upsample taps and attention projections computed in fp64 then rounded
# to fp32, residual and bias adds regrouped). Each step is a few fp32 ULPs (~1e-7 relative) of
# O(1) activations, compounded over ~10 layers; measured ~2e-6 of the output range. 1e-4 of
# the range leaves 50x margin and still catches any real mistake (a wrong tap or a missing
# bias moves outputs by O(1e-2) or more).
REL_TOL = 1e-4


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / (b.float().max() - b.float().min())).item()


# Fused modules of the tiny (32, 64) decoder with one layer per block: 2 res blocks + attention
# in the mid block, 2 res blocks per up block (x2), 1 upsample, and the decoder itself.
TINY_FUSED = 2 + 1 + 4 + 1 + 1


@pytest.fixture(scope="module")
def tiny():
    """An installed tiny VAE, its uninstalled twin, a latent and the stock output."""
    stock = tiny_vae()
    model = copy.deepcopy(stock)
    report = install.install_fast_path(model)
    z = _latent()
    return model, stock, z, _decode(stock, z)[0], report


# --- install contracts ------------------------------------------------------------------------


def test_install_recognises_and_fuses_every_module(tiny):
    model, _, _, _, report = tiny
    assert report.family == "kl"
    assert report.fused == TINY_FUSED and report.skipped == {} and report.reason is None
    assert isinstance(model.decoder.mid_block.resnets[0].norm1, FusedGroupNormSiLU)


def test_install_keeps_state_dict_and_is_idempotent():
    model = tiny_vae()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    report = install.install_fast_path(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # same Parameter objects
    assert install.install_fast_path(model) is report
    # Installing again through the family itself changes nothing either.
    again = install.InstallReport()
    kl.install(model, gate_for(model), again)
    assert again.fused == report.fused and again.skipped == report.skipped
    assert {n: type(m) for n, m in model.named_modules()} == classes


def test_closed_gate_is_bit_exact(tiny):
    model, _, z, expected, _ = tiny
    assert torch.equal(_decode(model, z)[0], expected)  # never opened
    out, stats = _decode(model, z, is_open=False)
    assert torch.equal(out, expected) and stats.fused_calls == 0


def test_lossless_inside_an_open_gate_is_bit_exact(tiny):
    model, _, z, expected, _ = tiny
    with torch.no_grad(), gate_for(model).opened(True):
        with gate_for(model).opened(False):
            out = model.decode(z).sample
    assert torch.equal(out, expected)


def test_high_is_close_to_lossless_and_keeps_the_output_layout(tiny):
    model, _, z, expected, _ = tiny
    out, stats = _decode(model, z, is_open=True)
    assert stats.fused_calls == TINY_FUSED and stats.fallbacks == {}
    assert out.is_contiguous() and out.dtype == expected.dtype and out.shape == expected.shape
    assert _rel_err(out, expected) < REL_TOL
    assert not torch.equal(out, expected)  # the fast path really ran


@pytest.mark.parametrize("setting, value", [
    ("upsample", "subpixel"),  # the other fold of nearest-2x + 3x3 conv
    ("upsample", "stock"),  # interpolate then the conv, channels-last
    ("attention", "sdpa"),  # SDPA instead of chunked matmul + softmax
    ("attention", "chunked"),
    ("attention_fp32_scores", True),
    ("row_softmax", True),  # the Triton row softmax in the chunked attention (off by default)
    ("attention", "exp_scores"),  # fp32 here: bf16 only, so the chunked softmax runs
])
def test_every_setting_stays_close(tiny, monkeypatch, setting, value):
    model, _, z, expected, _ = tiny
    monkeypatch.setattr(kl_settings.settings, setting, value)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {}
    assert _rel_err(out, expected) < REL_TOL


def test_norm_input_bias_folds_conv1_bias_into_norm2(tiny, monkeypatch):
    """``norm_input_bias``: each resnet block's conv1 bias goes into norm2 (no bias pass of its
    own), and the decode stays as close to stock as the default path."""
    model, _, z, expected, _ = tiny
    blocks = sum(1 for m in model.decoder.modules() if hasattr(m, "conv1") and hasattr(m, "norm2"))
    passes = {}
    real = kl_ops.bias_residual_add_
    for value in (False, True):
        calls = []
        monkeypatch.setattr(kl_ops, "bias_residual_add_",
                            lambda *a, calls=calls, **k: (calls.append(1), real(*a, **k))[1])
        monkeypatch.setattr(kl_settings.settings, "norm_input_bias", value)
        out, stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {} and stats.fused_calls == TINY_FUSED
        assert _rel_err(out, expected) < REL_TOL
        passes[value] = len(calls)
    assert blocks > 0 and passes[False] - passes[True] == blocks


def test_residual_norm_stats_skip_statistics_passes_and_change_no_bit(tiny, monkeypatch):
    """``residual_norm_stats``: a resnet block's closing add hands its sum's statistics to the
    next norm, which skips its own statistics pass; the decode is bit-identical to the setting
    off (same sum, same statistics, same norm). Blocks followed by a norm hand over; the last
    block before an upsampler's conv hands statistics nobody takes."""
    from fast_vae_decode.kernels import group_norm_silu as gns

    model, _, z, _, _ = tiny
    real_stats, real_take = gns._launch_stats, kl_ops.take_handed_stats
    outs, own_passes, handed = {}, {}, {}
    for value in (False, True):
        passes, taken = [], []
        monkeypatch.setattr(gns, "_launch_stats", lambda *a, passes=passes, **k: (
            passes.append(k["write_sum"]), real_stats(*a, **k))[1])
        monkeypatch.setattr(kl_ops, "take_handed_stats", lambda x, taken=taken: (
            lambda s: (taken.append(s is not None), s)[1])(real_take(x)))
        monkeypatch.setattr(kl_settings.settings, "residual_norm_stats", value)
        outs[value], stats = _decode(model, z, is_open=True)
        assert stats.fallbacks == {} and stats.fused_calls == TINY_FUSED
        own_passes[value] = passes.count(False)
        handed[value] = (passes.count(True), sum(taken))
    assert torch.equal(outs[True], outs[False])
    written, used = handed[True]
    assert handed[False] == (0, 0) and used >= 1 and written >= used
    assert own_passes[False] - own_passes[True] == used


@pytest.mark.parametrize("mode", ["none", "stats-plain+apply"])
def test_group_norm_prefetch_setting_reaches_every_norm_and_changes_no_bit(tiny, monkeypatch,
                                                                           mode):
    """``group_norm_prefetch``: every statistics pass and every apply pass of the decode is
    launched with that mode's prefetch flags (the residual-writing passes included, against the
    default's), and the decode's bits are the default's."""
    from fast_vae_decode.kernels import group_norm_silu as gns

    model, _, z, _, _ = tiny
    default, _ = _decode(model, z, is_open=True)
    real_launch, seen = gns.launch, []
    monkeypatch.setattr(gns, "launch", lambda kernel, grid, *a, **k: (
        seen.append((kernel, k.get("WRITE_SUM"), k.get("PREFETCH"))),
        real_launch(kernel, grid, *a, **k))[1])
    monkeypatch.setattr(kl_settings.settings, "group_norm_prefetch", mode)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and torch.equal(out, default)
    flags = gns.PREFETCH_MODES[mode]
    wanted = {
        (gns._group_norm_stats_kernel, False): flags.get("stats_prefetch", False),
        (gns._group_norm_stats_kernel, True): flags.get("stats_prefetch", False)
        and flags.get("stats_prefetch_residual", True),
        (gns._group_norm_apply_kernel, None): flags.get("apply_prefetch", False),
    }
    got = {}
    for kernel, write_sum, prefetch in seen:
        if (kernel, write_sum) in wanted:
            got.setdefault((kernel, write_sum), set()).add(prefetch)
    assert got == {key: {value} for key, value in wanted.items()}


def test_default_decode_hands_residual_statistics_on(tiny, monkeypatch):
    """The default (chosen on the GPU, settings.py says by how much) skips the statistics pass
    of every norm that follows a resnet block's closing add."""
    model, _, z, _, _ = tiny
    real_take, taken = kl_ops.take_handed_stats, []
    monkeypatch.setattr(kl_ops, "take_handed_stats",
                        lambda x: (lambda s: (taken.append(s is not None), s)[1])(real_take(x)))
    _, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and any(taken)


def test_handed_statistics_are_dropped_by_a_stock_path_between(monkeypatch):
    """Only a norm of the very tensor they were taken of uses them, and a block on its stock
    path in between clears them (it could have written anything)."""
    x = torch.zeros(1, 32, 2, 2).contiguous(memory_format=torch.channels_last)
    other = torch.zeros_like(x)
    with kl_ops.channels_last_decode():
        kl_ops.hand_off_stats(x, "stats")
        assert kl_ops.take_handed_stats(other) is None
        assert kl_ops.take_handed_stats(x) is None  # taken (and lost) by the other norm's call
        kl_ops.hand_off_stats(x, "stats")
        assert kl_ops.take_handed_stats(x) == "stats"

        class Stock(kl_ops.StockLayoutGuard, torch.nn.Identity):
            pass

        kl_ops.hand_off_stats(x, "stats")
        Stock()(x.contiguous())  # a stock path runs
        assert kl_ops.take_handed_stats(x) is None
    kl_ops.hand_off_stats(x, "stats")  # outside a fused decode nothing is kept
    assert kl_ops.take_handed_stats(x) is None


def test_flux2_and_flux_layouts_are_recognised():
    flux = tiny_vae(latent=16, use_quant_conv=False, use_post_quant_conv=False)
    assert install.install_fast_path(flux).fused == TINY_FUSED
    flux2 = _init_(diffusers.AutoencoderKLFlux2(**_config(latent=8)), 0)
    report = install.install_fast_path(flux2)
    assert report.family == "kl" and report.fused == TINY_FUSED


def test_bare_decoder_is_recognised_but_not_a_subclass():
    decoder = tiny_vae().decoder
    assert kl.matches(decoder)

    class NotTheDecoder(type(decoder)):
        pass

    other = tiny_vae().decoder
    other.__class__ = NotTheDecoder
    assert not kl.matches(other)


# --- fail closed ------------------------------------------------------------------------------


def test_group_norm_static_check_agrees_with_the_kernel():
    # (C, G): a KL width, a non-power-of-two group width inside the mask limit, one beyond it.
    for c, g in [(64, 32), (96, 32), (384, 128)]:
        norm = torch.nn.GroupNorm(g, c)
        x = torch.zeros(1, c, 2, 2).contiguous(memory_format=torch.channels_last)
        static = kl_ops.group_norm_static_reason(norm)
        kernel = group_norm_silu_unsupported(x, norm.weight.detach(), norm.bias.detach(), g)
        assert (static is None) == (kernel is None), (c, g, static, kernel)


def test_unsupported_channel_counts_stay_stock_per_module(monkeypatch):
    # Pretend the kernel takes at most 32 channels: the 64-channel modules must stay stock with
    # a reason, the 32-channel ones still fuse, and both gates still decode correctly.
    narrow = dataclasses.replace(group_norm_silu_module.GROUP_NORM_SILU, max_block_c=32)
    monkeypatch.setattr(group_norm_silu_module, "GROUP_NORM_SILU", narrow)
    stock = tiny_vae()
    model = copy.deepcopy(stock)
    report = install.install_fast_path(model)
    assert report.skipped and all("too wide" in r for r in report.skipped.values())
    assert "decoder.mid_block.attentions.0" in report.skipped
    assert "decoder.up_blocks.1.resnets.1" not in report.skipped  # 32 channels: fused
    assert report.fused > 0
    z = _latent()
    expected = _decode(stock, z)[0]
    assert torch.equal(_decode(model, z, is_open=False)[0], expected)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fused_calls > 0
    assert _rel_err(out, expected) < REL_TOL


def test_diffusers_decoder_with_an_odd_conv_in_stays_stock_alone():
    model = tiny_vae()
    model.decoder.conv_in = torch.nn.Conv3d(4, 64, 3, padding=1)
    report = install.InstallReport()
    kl.install(model, gate_for(model), report)
    # The blocks still fuse (they work on their own); the decoder is left stock with a reason.
    assert report.fused == TINY_FUSED - 1 and "Conv3d" in report.skipped["decoder"]


def test_decoder_with_a_foreign_child_stays_stock_and_exact():
    stock = tiny_vae()
    stock.decoder.up_blocks[0].upsamplers[0] = torch.nn.Upsample(scale_factor=2.0)
    model = copy.deepcopy(stock)
    report = install.install_fast_path(model)
    assert "Upsample" in report.skipped["decoder"] and report.fused == TINY_FUSED - 2
    z = _latent()
    expected = _decode(stock, z)[0]
    assert torch.equal(_decode(model, z, is_open=False)[0], expected)
    out, stats = _decode(model, z, is_open=True)  # the blocks still fuse, one by one
    assert stats.fused_calls == TINY_FUSED - 2 and out.is_contiguous()
    assert _rel_err(out, expected) < REL_TOL


def _comfy_named(name: str, base=torch.nn.Module, module="comfy.ldm.modules.diffusionmodules.model"):
    """A stand-in class with ComfyUI's qualified name (recognition is by name only)."""
    return type(name, (base,), {"__module__": module})


def test_comfy_classes_are_recognised_by_name_and_3d_fails_closed():
    decoder = _comfy_named("Decoder")()
    decoder.conv_in = torch.nn.Conv3d(4, 8, 3)  # Decoder(conv3d=True) builds VideoConv3d/Conv3d
    engine = _comfy_named("AutoencodingEngine", module="comfy.ldm.models.autoencoder")
    kl_model = _comfy_named("AutoencoderKL", base=engine, module="comfy.ldm.models.autoencoder")
    model = kl_model()
    model.decoder = decoder
    assert kl.matches(model)  # AutoencoderKL, and its base AutoencodingEngine (Flux), by MRO
    report = install.InstallReport()
    kl.install(model, gate_for(model), report)
    assert report.fused == 0 and "3-D" in report.reason
    # A subclass of ComfyUI's Decoder (temporal_ae.VideoDecoder) is not the KL decoder.
    model.decoder = _comfy_named("VideoDecoder", base=type(decoder),
                                 module="comfy.ldm.modules.temporal_ae")()
    assert not kl.matches(model)


def test_comfy_low_vram_cast_sends_that_module_to_stock(tiny, monkeypatch):
    model, _, z, expected, _ = tiny
    block = model.decoder.up_blocks[0].resnets[0]
    monkeypatch.setattr(block.conv1, "comfy_cast_weights", True, raising=False)
    out, stats = _decode(model, z, is_open=True)
    assert any("low-VRAM" in r for r in stats.fallbacks)
    assert stats.fused_calls == TINY_FUSED - 1
    assert _rel_err(out, expected) < REL_TOL


@pytest.mark.parametrize("why", ["compiling", "no triton", "autograd"])
def test_unavailable_fast_path_is_bit_exact(tiny, monkeypatch, why):
    model, _, z, expected, _ = tiny
    if why == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif why == "no triton":  # what a CPU tensor without TRITON_INTERPRET gets, everywhere
        monkeypatch.setattr(accepts_module, "triton_unavailable_reason", lambda x=None: "cpu tensor")
    with gate_for(model).opened(True) as stats:
        if why == "autograd":
            model.requires_grad_(True)
            try:
                out = model.decode(z).sample.detach()
            finally:
                model.requires_grad_(False)
        else:
            with torch.no_grad():
                out = model.decode(z).sample
    assert torch.equal(out, expected)
    assert stats.fused_calls == 0


def test_a_declining_child_gets_a_contiguous_input(tiny, monkeypatch):
    # The attention block declines inside the channels-last decode: its stock code must still
    # see the layout a stock decode gives it, and the decode must still be right.
    model, _, z, expected, _ = tiny
    attn = model.decoder.mid_block.attentions[0]
    processor, seen = attn.processor, []

    def recording_processor(attn_, hidden_states, *args, **kwargs):
        seen.append(hidden_states.is_contiguous())
        return processor(attn_, hidden_states, *args, **kwargs)

    monkeypatch.setattr(attn, "processor", recording_processor)
    monkeypatch.setattr(attn, "fast_unsupported", lambda x, *a, **k: "test says no",
                        raising=False)
    out, stats = _decode(model, z, is_open=True)
    assert seen == [True] and stats.fallbacks == {"test says no": 1}
    assert stats.fused_calls == TINY_FUSED - 1 and model.decoder._fvd_disabled is None
    assert _rel_err(out, expected) < REL_TOL


def test_standalone_norm_takes_the_kernel_only_for_channels_last(tiny):
    model = tiny[0]
    norm = model.decoder.conv_norm_out
    x = _latent((1, 32, 4, 4))
    expected = torch.nn.functional.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    with torch.no_grad(), gate_for(model).opened(True) as stats:
        contiguous = norm(x)
        channels_last = norm(x.contiguous(memory_format=torch.channels_last))
    assert torch.equal(contiguous, expected)
    assert stats.fused_calls == 1 and stats.fallbacks == {}  # contiguous: stock, not a fallback
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(channels_last, expected, rtol=1e-5, atol=1e-5)  # fp32 reordering


# --- caches and weights -----------------------------------------------------------------------


def test_fold_caches_appear_after_a_fast_decode_and_drop():
    model = tiny_vae()
    install.install_fast_path(model)
    assert cache.cache_bytes(model) == 0  # lazily built: nothing before the first fast decode
    _decode(model, _latent(), is_open=True)
    attn = model.decoder.mid_block.attentions[0]
    upsample = model.decoder.up_blocks[0].upsamplers[0]
    assert "attention_fold" in attn.__dict__["_fvd_cache"]
    assert "upsample_fold" in upsample.__dict__["_fvd_cache"]
    assert cache.cache_bytes(model) > 0
    keys = list(model.state_dict())
    assert cache.drop_fast_path_caches(model) > 0
    assert cache.cache_bytes(model) == 0 and list(model.state_dict()) == keys


def test_load_state_dict_into_an_installed_model():
    model = tiny_vae(seed=0)
    install.install_fast_path(model)
    z = _latent()
    _decode(model, z, is_open=True)  # caches now hold folds of the seed-0 weights
    other = tiny_vae(seed=5)
    model.load_state_dict(other.state_dict())
    expected = _decode(other, z)[0]
    assert torch.equal(_decode(model, z, is_open=False)[0], expected)
    out, _ = _decode(model, z, is_open=True)
    assert _rel_err(out, expected) < REL_TOL  # stale folds would be far off


@pytest.mark.parametrize("batch, tokens, expected", [
    (1, 6144, "sdpa"),  # one SD1.5 768x512 image: below the threshold
    (4, 6144, "chunked"),  # the same images as a batch of 4: the batch's tokens count
    (1, 16384, "chunked"),  # one SDXL 1024² image
    (1, 65536, "exp_scores"),  # one SDXL 2048² image, with auto_exp_scores
    (2, 16384, "exp_scores"),  # two 1024² images, with auto_exp_scores
    (1, 65536, "chunked"),  # with auto_exp_scores turned off
])
def test_auto_attention_counts_the_batch_tokens(monkeypatch, batch, tokens, expected):
    chosen = []
    monkeypatch.setattr(kl_modules, "attention_sdpa", lambda q, k, v: chosen.append("sdpa"))
    monkeypatch.setattr(kl_modules, "attention_chunked",
                        lambda q, k, v, **options: chosen.append("chunked"))
    monkeypatch.setattr(kl_modules, "exp_scores_attention_unsupported", lambda q, k, v: None)
    monkeypatch.setattr(kl_modules, "attention_exp_scores",
                        lambda q, k, v, tripped: chosen.append("exp_scores"))
    monkeypatch.setattr(kl_settings.settings, "attention", "auto")
    monkeypatch.setattr(kl_settings.settings, "chunked_min_tokens", 8192)
    monkeypatch.setattr(kl_settings.settings, "exp_scores_min_tokens", 32768)
    monkeypatch.setattr(kl_settings.settings, "auto_exp_scores", expected == "exp_scores")
    q = torch.empty(batch, tokens, 8)
    kl_modules.attend(q, q, q)
    assert chosen == [expected]


def test_exp_scores_keeps_the_chunked_softmax_for_what_it_does_not_take(monkeypatch):
    chosen = []
    monkeypatch.setattr(kl_modules, "attention_chunked",
                        lambda q, k, v, **options: chosen.append("chunked"))
    monkeypatch.setattr(kl_settings.settings, "attention", "exp_scores")
    q = torch.empty(1, 64, 8)  # fp32: exp_scores is bf16 only
    kl_modules.attend(q, q, q)
    assert chosen == ["chunked"]


@pytest.mark.parametrize("trip", [False, True])
def test_a_tripped_exp_scores_decode_runs_again_on_the_softmax(tiny, monkeypatch, trip):
    """The decoder reads the range flag once the decode is done: a tripped decode is run again
    with the exp_scores path suspended, and its output is the softmax attention's; an
    untripped one is kept as it is (one decode)."""
    model, _, z, _, _ = tiny
    monkeypatch.setattr(kl_settings.settings, "attention", "chunked")
    expected, _ = _decode(model, z, is_open=True)
    calls = []

    def fake(q, k, v, tripped):  # the softmax's values, or junk with the flag set
        calls.append(1)
        if trip:
            tripped.fill_(True)
            return torch.zeros_like(v)
        options = kl_settings.settings
        return kl_modules.attention_chunked(q, k, v, fp32_scores=options.attention_fp32_scores,
                                            row_softmax=options.row_softmax)

    monkeypatch.setattr(kl_modules, "exp_scores_attention_unsupported", lambda q, k, v: None)
    monkeypatch.setattr(kl_modules, "attention_exp_scores", fake)
    monkeypatch.setattr(kl_settings.settings, "attention", "exp_scores")
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {}
    assert calls == [1]  # the second decode, if any, did not ask exp_scores
    assert torch.equal(out, expected)
    assert not exp_scores_guard.suspended


def test_the_guard_reads_the_flag_only_for_decodes_that_took_the_path():
    """A graph replay runs no Python: the guard remembers which decode keys took the path
    when they ran eagerly (or were captured) and reads the flag after every decode of those
    keys; other decodes never read it (no host sync)."""
    guard = ExpScoresGuard()
    device = torch.device("cpu")
    with guard.watch(("a",), device) as tripped:
        guard.flag(device).fill_(True)  # an eager decode of key a takes the path and trips
    assert tripped == [True]
    with guard.watch(("a",), device) as tripped:
        assert not guard.flag(device)  # cleared before each decode
    assert tripped == [False]
    flag = guard.flag(device)
    with guard.watch(("a",), device) as tripped:
        flag.fill_(True)  # a replay of key a writes the flag; no Python asked for it
    assert tripped == [True]
    with guard.watch(("b",), device) as tripped:
        flag.fill_(True)  # key b never took the path: not read
    assert tripped == [False]
    assert guard.flag(device) is flag  # one flag per device for the process (graphs hold it)


def test_a_flag_first_asked_in_inference_mode_is_cleared_outside_it():
    # ComfyUI decodes (and the warm-up runs) in inference mode; a later decode outside it
    # clears the flag in place, which an inference tensor would refuse.
    guard = ExpScoresGuard()
    device = torch.device("cpu")
    with torch.inference_mode():
        with guard.watch(("a",), device) as tripped:
            guard.flag(device).fill_(True)
    assert tripped == [True]
    with guard.watch(("a",), device) as tripped:
        pass
    assert tripped == [False]


@pytest.mark.parametrize("kept", [True, False])
def test_channels_last_convs_get_channels_last_weights(tiny, monkeypatch, kept):
    """Every conv the open gate runs on a channels-last input is handed a channels-last weight
    (kept per weight version), so PyTorch does not convert the weight on each call; the
    setting off hands over the module's own (contiguous) weight."""
    model, _, z, expected, _ = tiny
    monkeypatch.setattr(kl_settings.settings, "channels_last_weights", kept)
    real = torch.nn.functional.conv2d
    calls = []

    def spy(x, weight, *args, **kwargs):
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and weight.shape[-1] > 1:
            calls.append(weight.is_contiguous(memory_format=torch.channels_last))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(kl_ops.F, "conv2d", spy)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and calls and all(c is kept for c in calls)
    assert _rel_err(out, expected) < REL_TOL


def test_fast_silu_setting_reaches_every_apply_pass_and_keeps_handed_statistics(tiny,
                                                                                 monkeypatch):
    """``fast_silu``: every apply pass of the decode asks for SiLU's MUFU form, the norms
    after a residual add still take its handed statistics (they were taken without asking for
    a form), and where the form cannot compile (here: the interpreter) the bits are the
    default's."""
    from fast_vae_decode.kernels import group_norm_silu as gns

    model, _, z, _, _ = tiny
    default, _ = _decode(model, z, is_open=True)
    real_use, asked = gns.use_fast_silu, []
    monkeypatch.setattr(gns, "use_fast_silu", lambda wanted, device: (
        asked.append(wanted), real_use(wanted, device))[1])
    real_take, taken = kl_ops.take_handed_stats, []
    monkeypatch.setattr(kl_ops, "take_handed_stats",
                        lambda x: (lambda s: (taken.append(s is not None), s)[1])(real_take(x)))
    monkeypatch.setattr(kl_settings.settings, "fast_silu", True)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and torch.equal(out, default)
    assert asked and all(asked)
    # A statistics pass is skipped only where the statistics were used, not just handed over.
    real_stats, own = gns._launch_stats, []
    monkeypatch.setattr(gns, "_launch_stats", lambda *a, **k: (
        own.append(k["write_sum"]), real_stats(*a, **k))[1])
    taken.clear()
    asked.clear()
    _decode(model, z, is_open=True)
    assert any(taken) and own.count(True) >= sum(taken) >= 1
    assert own.count(False) + sum(taken) == len(asked)


def test_winograd_setting_routes_wide_resnet_convs_and_stays_close(monkeypatch):
    """``winograd_min_channels``: the resnet 3x3 convs with that many input channels run on
    ``winograd_conv`` (bf16 decode; the kernel takes half types only), the others on cuDNN, and
    the decode stays as close to the default fast decode as bf16 rounding allows. 0 (the
    default) routes none."""
    stock = tiny_vae().to(torch.bfloat16)
    model = copy.deepcopy(stock)
    install.install_fast_path(model)
    z = _latent(dtype=torch.bfloat16)
    real = kl_ops.winograd_conv
    widths = []
    monkeypatch.setattr(kl_ops, "winograd_conv",
                        lambda x, u: (widths.append(x.shape[1]), real(x, u))[1])
    default, _ = _decode(model, z, is_open=True)
    assert widths == []
    monkeypatch.setattr(kl_settings.settings, "winograd_min_channels", 64)
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {}
    resnet_convs_at_64 = sum(
        1 for m in model.decoder.modules() if hasattr(m, "conv1") and hasattr(m, "norm2")
        for conv in (m.conv1, m.conv2) if conv.in_channels >= 64)
    assert len(widths) == resnet_convs_at_64 > 0 and min(widths) >= 64
    # bf16 activations either way; Winograd's fp16 products move outputs by a few bf16 steps.
    assert _rel_err(out, default) < 3e-2
    assert not torch.equal(out, default)


def test_winograd_setting_leaves_an_fp32_decode_on_cudnn_without_transforming_weights(
        tiny, monkeypatch):
    """The kernel takes half types only: an fp32 decode with the setting on stays on cuDNN,
    as close to stock as ever, and no transformed weight is made or kept."""
    model, _, z, expected, _ = tiny
    monkeypatch.setattr(kl_settings.settings, "winograd_min_channels", 1)
    made = []
    real = kl_ops.winograd_weight
    monkeypatch.setattr(kl_ops, "winograd_weight", lambda w: (made.append(1), real(w))[1])
    out, stats = _decode(model, z, is_open=True)
    assert stats.fallbacks == {} and made == []
    assert _rel_err(out, expected) < REL_TOL


def test_padded_grid_route_runs_every_routed_resnet_conv_on_the_grid(tiny, monkeypatch):
    """``padded_grid_conv`` (the KL setting) forced on the CPU, the kernel's GEMM twin standing
    in for the DSL and the tiny decoder's widths standing in for the measured tilings: every
    resnet conv reads a zero-bordered grid its norm wrote (``group_norm_silu``'s ``out``), and
    the decode stays as close to stock as the default fast path (the same sums, fp32 here).
    With ``padded_grid_min_pixels`` past the smallest routed batch, those convs stay on cuDNN."""
    from fast_vae_decode.kernels import padded_grid_conv as pgc

    model, _, z, expected, _ = tiny
    default, _ = _decode(model, z, is_open=True)
    widths = {(m.in_channels, m.out_channels, 1) for m in model.decoder.modules()
              if isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) == (3, 3)}
    pixels = []  # per routed conv: frames (the batch) x H x W of the grid's interior
    tilings = []  # per routed conv: the tiling it asked for (None: its measured one)

    def twin(padded, packed, bias=None, residual=None, tiling=None):
        _, _, t, h2, w2 = padded.shape
        pixels.append(t * (h2 - 2) * (w2 - 2))
        tilings.append(tiling)
        return pgc.padded_grid_gemm_reference(padded, packed, bias, residual)

    monkeypatch.setattr(kl_ops, "_PADDED_GRID_SHAPES", widths)
    monkeypatch.setattr(kl_ops, "grid_device_ready", lambda x: True)
    monkeypatch.setattr(kl_ops, "padded_grid_conv", twin)
    monkeypatch.setattr(kl_settings.settings, "padded_grid_conv", True)
    monkeypatch.setattr(kl_settings.settings, "padded_grid_min_pixels", 0)
    out, stats = _decode(model, z, is_open=True)
    resnet_convs = 2 * sum(1 for m in model.decoder.modules()
                           if hasattr(m, "conv1") and hasattr(m, "norm2"))
    assert stats.fallbacks == {} and len(pixels) == resnet_convs > 0
    assert _rel_err(out, expected) < REL_TOL
    assert _rel_err(out, default) < REL_TOL
    floor = min(pixels) + 1
    pixels.clear()
    monkeypatch.setattr(kl_settings.settings, "padded_grid_min_pixels", floor)
    again, _ = _decode(model, z, is_open=True)
    assert 0 < len(pixels) < resnet_convs and min(pixels) >= floor
    assert _rel_err(again, expected) < REL_TOL
    # ``padded_grid_candidate`` asks each routed conv for its shape's candidate tiling
    assert tilings and set(tilings) == {None}
    candidate = pgc.Tiling(128, 8, 16, 1, 2)
    monkeypatch.setattr(pgc, "SWEEP_TILINGS", {w: (candidate,) for w in widths})
    monkeypatch.setattr(kl_settings.settings, "padded_grid_candidate", 0)
    tilings.clear()
    swept, _ = _decode(model, z, is_open=True)
    assert tilings and set(tilings) == {candidate}
    assert torch.equal(swept, again)  # the twin computes the same whatever the tiling
