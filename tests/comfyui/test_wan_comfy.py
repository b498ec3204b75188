"""Tier 2: the Wan family and decode precision on ComfyUI's own ``WanVAE`` classes.

``comfy.sd.VAE`` built from seeded random state dicts (``bench.models.comfy_vae``, tiny widths,
detected from the keys as a checkpoint is), decoded through ComfyUI's ``VAEDecode``; runs under
``torch.inference_mode()`` as ComfyUI's executor does. The Triton interpreter stays on (tier 1's
``conftest``), so ``high`` really runs the fused kernels here, on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.families.wan.precision import with_decoder_precision
from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings
from fast_vae_decode.fastpath.gate import gate_for, gates_opened
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.fastpath.swap import is_swapped
from support.comfy_env import comfy_nodes, loaded_pack, requires_comfyui
from support.gated import stock_and_gated
from support.wan_models import psnr

pytestmark = [requires_comfyui, pytest.mark.comfyui]

# (architecture, latent shape)
CASES = [
    ("wan21", (1, 16, 2, 8, 8)),  # the plain case: first chunk + one steady-state chunk
    ("wan21", (2, 16, 3, 3, 5)),  # batch 2, odd sizes, a third chunk on 2-frame caches
    ("wan21", (1, 16, 1, 4, 6)),  # one latent frame: the loop returns the chunk itself
    ("wan22", (1, 48, 2, 4, 6)),  # Wan 2.2: Up_ResidualBlock, DupUp3D, first_chunk, unpatchify
    ("wan22", (1, 48, 3, 3, 5)),  # Wan 2.2, odd sizes and a third chunk
]
IDS = [f"{a}-{'x'.join(map(str, s))}" for a, s in CASES]
COMFY_DECODER_SIDE = ("decoder.", "conv2.")


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _decode(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


@pytest.fixture(scope="module")
def vaes():
    """Per architecture: a stock VAE and one with the fast path installed (same weights)."""
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    out = {}
    for arch in ("wan21", "wan22"):
        fast = comfy_vae(arch, seed=0, tiny=True)
        report = install_fast_path(fast.first_stage_model)
        out[arch] = (comfy_vae(arch, seed=0, tiny=True), fast, report)
    return out


@pytest.mark.parametrize("arch", ["wan21", "wan22"])
def test_installs_into_comfyuis_wan_vae(vaes, arch):
    _, vae, report = vaes[arch]
    assert report.family == "wan" and report.reason is None and report.skipped == {}
    model = vae.first_stage_model
    assert model._fvd_loop is True  # this tree's WanVAE.decode is a loop we know
    assert all(is_swapped(m) for m in model.decoder.modules()
               if type(m).__name__.endswith(("ResidualBlock]", "CausalConv3d]", "AttentionBlock]")))
    assert not any(is_swapped(m) for m in model.encoder.modules())
    # Every RMS_norm of this tree passed the install-time formula probe: lossless runs them as
    # one exact pass (the fused head norm has the same stock path).
    norms = [m for m in model.decoder.modules() if type(m).__name__.endswith("RMS_norm]")]
    assert norms and all(m._fvd_exact for m in norms)
    # The head's SiLU goes into the fused head norm's kernel (``SiLUAfterNorm``).
    from fast_vae_decode.fastpath.families.wan.install import head_norms, head_silu
    from fast_vae_decode.fastpath.families.wan.modules import SiLUAfterNorm

    assert isinstance(head_silu(model.decoder), SiLUAfterNorm)
    assert head_norms(model.decoder)[0]._fvd_silu


@pytest.mark.parametrize("arch,shape", CASES, ids=IDS)
def test_lossless_equals_vae_decode(vaes, arch, shape):
    stock, vae, _ = vaes[arch]
    z = _latent(shape)
    expected, got, _ = stock_and_gated(_decode, stock, vae, z, False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch,shape", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_preallocated_loop_equals_the_trees_own_loop_with_fused_modules(vaes, arch, shape,
                                                                      monkeypatch):
    # The tree's own loop calls the decoder for the first frame alone: so does the pack's here.
    monkeypatch.setattr(wan_settings, "join_first_chunk", False)
    _, vae, _ = vaes[arch]
    model = vae.first_stage_model
    z = _latent(shape)
    with torch.inference_mode(), gate_for(model).opened(True):
        assert torch.equal(model.decode(z), model._fvd_stock_class.decode(model, z))


@pytest.mark.parametrize("arch,shape", CASES, ids=IDS)
def test_high_close_to_lossless(vaes, arch, shape):
    stock, vae, _ = vaes[arch]
    z = _latent(shape)
    expected, got, stats = stock_and_gated(_decode, stock, vae, z, True)
    assert stats.fallbacks == {} and stats.fused_calls > 0
    # fp32 on the CPU: reduction order and conv kernels differ at ~1e-7 relative per layer;
    # VAEDecode's images are in [0, 1].
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,shape", [("wan21", (1, 16, 4, 3, 5)), ("wan22", (1, 48, 4, 3, 5))],
                         ids=["wan21-4-frames", "wan22-4-frames"])
@pytest.mark.parametrize("three", [False, True], ids=["two-parts", "three-parts-in-pieces"])
def test_blocks_read_cached_frames_in_place_in_this_trees_loop(vaes, arch, shape, three,
                                                               monkeypatch):
    """``split_cached_frames`` in this tree's own decode loop, the 2-D taps forced on the CPU:
    the residual blocks meet new frames behind two cached ones (0.33's ``run_up`` pieces of
    two, with either ``three_parts_in_pieces``; 0.8's chunks of four), read those in place,
    and high stays close to lossless over four latent frames (later chunks read caches written
    that way)."""
    from fast_vae_decode.fastpath.families.wan import ops as wan_ops

    monkeypatch.setattr(wan_ops.settings, "three_parts_in_pieces", three)
    monkeypatch.setattr(wan_ops, "_as_2d_taps", lambda conv, inp: (
        inp.shape[0] == 1 and tuple(conv.kernel_size) == (3, 3, 3)))
    split, real = [], wan_ops.split_tap_parts
    monkeypatch.setattr(wan_ops, "split_tap_parts",
                        lambda conv, prev, new, *pad: (split.append(new), real(conv, prev, new, *pad))[1])
    stock, vae, _ = vaes[arch]
    expected, got, stats = stock_and_gated(_decode, stock, vae, _latent(shape), True)
    assert stats.fallbacks == {} and stats.fused_calls > 0 and split
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["wan21", "wan22"])
def test_precision_copy_of_a_comfy_vae(vaes, arch):
    import comfy.model_patcher

    vae, _, _ = vaes[arch]
    z = _latent((1, 16 if arch == "wan21" else 48, 2, 4, 6))
    with torch.inference_mode():
        expected = _decode(vae, z)
        attrs = dict(vars(vae))
        new = with_decoder_precision(vae, "bf16")
        got = _decode(new, z)
        assert vars(vae) == attrs and torch.equal(_decode(vae, z), expected)  # untouched
    model = new.first_stage_model
    assert model is not vae.first_stage_model
    assert isinstance(new.patcher, comfy.model_patcher.ModelPatcher) and new.patcher.model is model
    assert new.patcher is not vae.patcher
    for name, p in model.named_parameters():
        want = torch.bfloat16 if name.startswith(COMFY_DECODER_SIDE) else torch.float32
        assert p.dtype == want, name
    assert all(p.dtype == vae.vae_dtype for p in vae.first_stage_model.parameters())
    assert got.shape == expected.shape and torch.isfinite(got).all()
    # bf16 decoder: 8 mantissa bits, ~20 layers; images in [0, 1] (peak 1).
    assert psnr(got, expected, peak=1.0) >= 30.0


def test_fp32_precision_copy_decodes_exactly(vaes):
    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 2, 4, 6))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "fp32")
        if vae.vae_dtype == torch.float32:  # ComfyUI's choice on the CPU
            assert torch.equal(_decode(new, z), _decode(vae, z))


def test_precision_copy_encodes_with_the_fp32_encoder(vaes):
    vae, _, _ = vaes["wan21"]
    pixels = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "fp16")
        latent = comfy_nodes().VAEEncode().encode(new, pixels)[0]["samples"]
        if vae.vae_dtype == torch.float32:
            expected = comfy_nodes().VAEEncode().encode(vae, pixels)[0]["samples"]
            assert torch.equal(latent, expected)
    assert latent.dtype == torch.float32 and latent.shape[:3] == (1, 16, 2)


def test_precision_node_then_fast_decode(vaes):
    pack = loaded_pack()
    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 2, 4, 6))
    with torch.inference_mode():
        new = pack["WanVAEDecodePrecision"].execute(vae=vae, precision="fp16").args[0]
        lossless = _decode(new, z)
        install_fast_path(new.first_stage_model)
        with gates_opened(new, False):
            assert torch.equal(_decode(new, z), lossless)
        with gates_opened(new, True):
            high = _decode(new, z)
    assert torch.isfinite(high).all()
    assert psnr(high, lossless, peak=1.0) >= 30.0  # fp16 activations, rounded differently


def test_unloading_the_copy_leaves_the_original_loaded_state_alone(vaes):
    import comfy.model_management as mm

    vae, _, _ = vaes["wan21"]
    z = _latent((1, 16, 1, 4, 6))
    with torch.inference_mode():
        new = with_decoder_precision(vae, "bf16")
        _decode(new, z)
        expected = _decode(vae, z)
        mm.unload_all_models()
        assert torch.equal(_decode(vae, z), expected)
        _decode(new, z)  # the copy loads again on its own


# --- what the wing fuses, counted on the tree's own classes ------------------------------------


def _known_modules(model) -> int:
    """The fused modules the Wan wing knows for a ComfyUI Wan decoder: every causal conv,
    residual block, attention block, upsampling resample, Wan 2.2 up-shortcut and the head norm,
    plus the decode loop."""
    names = ("CausalConv3d", "ResidualBlock", "AttentionBlock", "DupUp3D")
    count = 1 + 1  # the decode loop and the head norm
    for m in model.decoder.modules():
        name = type(m).__dict__.get("_fvd_stock_class", type(m)).__qualname__
        if name in names or (name == "Resample" and m.mode in ("upsample2d", "upsample3d")):
            count += 1
    return count


def test_default_config_wan21_fuses_every_module_the_wing_knows():
    """ComfyUI's default Wan 2.1 VAE config (what ``comfy.sd.VAE`` builds for a real checkpoint):
    on 0.33+ trees this fused 3 of 53 before the wing knew the int causal padding and 0.33's
    forwards."""
    comfy_nodes()
    import comfy.ldm.wan.vae

    from fast_vae_decode.bench.models import _wan_config

    model = comfy.ldm.wan.vae.WanVAE(**_wan_config("wan21", tiny=False)).eval()
    report = install_fast_path(model)
    assert report.reason is None and report.skipped == {}
    assert report.fused == _known_modules(model) == 53
    assert model._fvd_loop is True


@pytest.mark.parametrize("arch", ["wan21", "wan22"])
def test_tiny_vae_fuses_every_module_the_wing_knows(vaes, arch):
    _, vae, report = vaes[arch]
    assert report.skipped == {} and report.fused == _known_modules(vae.first_stage_model)


def test_even_latent_count_ends_on_a_single_frame_chunk(vaes):
    """0.33's loop takes latent frames 1+2+2+...; an even count ends on a one-frame call (and
    0.8's runs per frame): lossless stays exact and high close either way."""
    stock, vae, _ = vaes["wan21"]
    z = _latent((1, 16, 4, 4, 6), seed=3)
    with torch.inference_mode():
        expected = _decode(stock, z)
        with gates_opened(vae, False):
            assert torch.equal(_decode(vae, z), expected)
        with gates_opened(vae, True) as stats:
            got = _decode(vae, z)
    assert stats[0].fallbacks == {} and stats[0].fused_calls > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# Latent frames -> the frames of each decoder call: this tree's loop, then joined
# (``join_first``). 0.33's loop takes 1 + 2 + 2 + ..., 0.8's one frame at a time.
JOIN_CALLS = {
    "chunked": {2: ([1, 1], [2]), 3: ([1, 2], [3]), 4: ([1, 2, 1], [3, 1]),
                5: ([1, 2, 2], [3, 2])},
    "per_frame": {2: ([1, 1], [2]), 3: ([1, 1, 1], [2, 1]), 4: ([1, 1, 1, 1], [2, 1, 1]),
                  5: ([1] * 5, [2, 1, 1, 1])},
}


def _joined_decode(model, z, join: bool, monkeypatch):
    """``(model.decode(z) with the gate open, frames of each decoder call)``."""
    monkeypatch.setattr(wan_settings, "join_first_chunk", join)
    monkeypatch.setattr(wan_settings, "join_per_frame", join)
    calls = []
    hook = model.decoder.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[2]))
    try:
        with torch.inference_mode(), gate_for(model).opened(True):
            return model.decode(z), calls
    finally:
        hook.remove()


@pytest.mark.parametrize("arch,frames", [("wan21", 2), ("wan21", 3), ("wan21", 4), ("wan21", 5),
                                         ("wan22", 3)])  # 3 on 0.33: one joined call in all
def test_joined_first_call_gives_this_trees_frames_in_fp64(arch, frames, monkeypatch):
    """The first latent frame decoded in the next chunk's call, on this tree's decoder and loop
    (0.33's Wan 2.1: its pieces of two, with the first frame in front of the first pair; Wan
    2.2: its DupUp3D shortcuts' first-chunk rule). fp64: the kernels take none, so every module
    runs its stock code and only the joining is checked."""
    from fast_vae_decode.bench.models import comfy_vae
    from fast_vae_decode.fastpath.families.wan.join_first import JoinedRunUp

    comfy_nodes()
    stock = comfy_vae(arch, seed=0, tiny=True).first_stage_model.double()
    model = comfy_vae(arch, seed=0, tiny=True).first_stage_model.double()
    install_fast_path(model)
    loop = model._fvd_loop_code.loop
    assert isinstance(model.decoder, JoinedRunUp) == (loop == "chunked")
    z = _latent((1, 16 if arch == "wan21" else 48, frames, 3, 5), seed=4).double()
    with torch.inference_mode():
        expected = stock.decode(z)
    unjoined, calls = _joined_decode(model, z, False, monkeypatch)
    got, joined_calls = _joined_decode(model, z, True, monkeypatch)
    assert (calls, joined_calls) == JOIN_CALLS[loop][frames]
    assert torch.equal(unjoined, expected)  # every module stock: the tree's own loop, exactly
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_joined_first_call_on_the_fused_modules_stays_close(vaes, monkeypatch):
    stock, vae, _ = vaes["wan21"]
    model = vae.first_stage_model
    z = _latent((1, 16, 5, 3, 5), seed=5)
    unjoined, _ = _joined_decode(model, z, False, monkeypatch)
    got, calls = _joined_decode(model, z, True, monkeypatch)
    assert calls == JOIN_CALLS[model._fvd_loop_code.loop][5][1]
    torch.testing.assert_close(got, unjoined, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(got, stock.first_stage_model.decode(z), rtol=1e-4, atol=1e-4)


def test_by_default_only_the_chunked_loop_joins(vaes):
    """``join_per_frame`` is off by default: 0.33+'s chunked loop joins its first call, a
    per-frame loop (0.8's) keeps stock's one-frame calls."""
    model = vaes["wan21"][1].first_stage_model
    loop = model._fvd_loop_code.loop
    calls = []
    hook = model.decoder.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[2]))
    try:
        with torch.inference_mode(), gate_for(model).opened(True):
            model.decode(_latent((1, 16, 5, 3, 5), seed=5))
    finally:
        hook.remove()
    unjoined, joined = JOIN_CALLS[loop][5]
    assert calls == (joined if loop == "chunked" else unjoined)


def _piece_frames(model, z, join: bool, monkeypatch) -> tuple[list[int], list[int], torch.Tensor]:
    """``(frames of each call of the first block after the first temporal upsample, of the
    last head conv (one call per piece at full size), the decode)``."""
    from comfy.ldm.wan.vae import CausalConv3d

    from fast_vae_decode.fastpath.families.wan.join_first import is_temporal_upsample

    ups = model.decoder.upsamples
    first_up = next(i for i, m in enumerate(ups) if is_temporal_upsample(m))
    head = [m for m in model.decoder.head if isinstance(m, CausalConv3d)][-1]
    mid, full = [], []
    hooks = [ups[first_up + 1].register_forward_pre_hook(lambda m, a: mid.append(a[0].shape[2])),
             head.register_forward_pre_hook(lambda m, a: full.append(a[0].shape[2]))]
    try:
        out, _ = _joined_decode(model, z, join, monkeypatch)
    finally:
        for hook in hooks:
            hook.remove()
    return mid, full, out


# What each cut does to the first pieces below and at full size, against stock's [1, 2, ...].
FIRST_PIECES = {"stock": (1, 1), "ride": (3, 3), "ride_below_last": (3, 1)}


@pytest.mark.parametrize("pieces", sorted(FIRST_PIECES))
def test_joined_first_call_cuts_the_pieces_its_setting_names(pieces, monkeypatch):
    """Peak memory: by default (``join_pieces="ride_below_last"``) a joined call's first frame
    rides in front of the first pair only below full size; there it is a piece of its own, as in
    stock's calls, so no full-size piece is larger than a stock one. A three-frame first piece
    down to full size ("ride") put Wan 2.1 x33's peak over stock's on 0.33
    (docs/benchmark/s35). Every cut gives the stock loop's frames (fp64: every module runs its
    stock code)."""
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    stock = comfy_vae("wan21", seed=0, tiny=True).first_stage_model.double()
    model = comfy_vae("wan21", seed=0, tiny=True).first_stage_model.double()
    install_fast_path(model)
    if model._fvd_loop_code.loop != "chunked":
        pytest.skip("this tree's decoder does not cut frames into pieces (ComfyUI before 0.33)")
    monkeypatch.setattr(wan_settings, "join_pieces", pieces)
    z = _latent((1, 16, 5, 3, 5), seed=6).double()
    with torch.inference_mode():
        expected = stock.decode(z)
    stock_mid, stock_full, _ = _piece_frames(model, z, False, monkeypatch)
    assert stock_mid[0] == stock_full[0] == 1 and set(stock_mid[1:]) == set(stock_full[1:]) == {2}
    mid, full, got = _piece_frames(model, z, True, monkeypatch)
    assert (mid[0], full[0]) == FIRST_PIECES[pieces]
    assert set(mid[1:]) == set(full[1:]) == {2}
    assert sum(full) == sum(stock_full)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_unknown_block_code_stays_stock_with_its_reason():
    """Fail closed: a ResidualBlock whose forward is code this pack has not seen keeps it."""
    comfy_nodes()
    import comfy.ldm.wan.vae as v21

    from fast_vae_decode.bench.models import _wan_config

    model = v21.WanVAE(**_wan_config("wan21", tiny=True)).eval()

    def forward(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006  (another block's code)
        return self.residual(x) * 2 + self.shortcut(x)

    other = type("ResidualBlock", (v21.ResidualBlock,), {"__module__": v21.__name__, "forward": forward})
    model.decoder.middle[0].__class__ = other
    report = install_fast_path(model)
    assert report.skipped == {
        "decoder.middle.0": "unrecognised comfy.ldm.wan.vae.ResidualBlock.forward (a newer version?)"}
    assert not is_swapped(model.decoder.middle[0])


# --- newest upstream vae2_2.WanVAE (the Qwen-Image 2.1 VAE shape), from the tree's classes ------
# Upstream's vae2_2 builds its block and head convs as CausalConv3d(in, out, (k, 3, 3), padding
# (k // 2, 1, 1)) and the temporal-upsample conv as (k, 1, 1) with padding k // 2 from a
# ``temporal_kernel`` k, the head to ``image_channels * patch_size**2`` channels, keeps
# ``patch_size`` on the model, and its ``decode`` takes 4-D latents (one pass without a cache,
# ``first_chunk``, the frame axis squeezed off again) besides the per-frame 5-D loop, unpatchifying
# by ``self.patch_size``; for that its Decoder3d hands ``first_chunk`` to the up blocks also when
# there is no frame cache. The tree's own Resample/ResidualBlock forwards are upstream's.


def _upstream_decoder_forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006
    if feat_cache is not None:
        return super(type(self), self).forward(x, feat_cache, feat_idx, first_chunk)
    x = self.conv1(x)
    for layer in self.middle:
        x = layer(x)
    for layer in self.upsamples:
        x = layer(x, first_chunk=first_chunk)
    for layer in self.head:
        x = layer(x)
    return x


def _upstream_decode(self, z):
    if z.ndim == 4:  # a single image: no frame cache
        image = self.decoder(self.conv2(z.unsqueeze(2)), first_chunk=True)
        return unpatchify(image, patch_size=self.patch_size).squeeze(2)  # noqa: F821
    cache = [None] * count_conv3d(self.decoder)  # noqa: F821
    x = self.conv2(z)
    out = None
    for i in range(z.shape[2]):
        chunk = self.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
        out = chunk if out is None else torch.cat([out, chunk], 2)
    return unpatchify(out, patch_size=self.patch_size)  # noqa: F821


def _upstream_wan22(seed: int = 0, temporal_kernel: int = 1, image_channels: int = 4,
                    patch_size: int = 1, z_dim: int = 64):
    comfy_nodes()
    import comfy.ldm.wan.vae as v21
    import comfy.ldm.wan.vae2_2 as v22

    from fast_vae_decode.bench.models import init_weights_

    globals().update(unpatchify=v22.unpatchify, count_conv3d=v22.count_conv3d)
    model = v22.WanVAE(dim=16, dec_dim=32, z_dim=z_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                       attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)
    k = temporal_kernel

    def conv3x3(cin, cout):
        return v21.CausalConv3d(cin, cout, (k, 3, 3), padding=(k // 2, 1, 1))

    dec = model.decoder
    dec.conv1 = conv3x3(dec.conv1.in_channels, dec.conv1.out_channels)
    for m in dec.modules():
        if isinstance(m, v22.ResidualBlock):
            for i in (2, 6):
                m.residual[i] = conv3x3(m.residual[i].in_channels, m.residual[i].out_channels)
        elif isinstance(m, v22.Resample) and m.mode == "upsample3d":
            m.time_conv = v21.CausalConv3d(m.dim, 2 * m.dim, (k, 1, 1), padding=(k // 2, 0, 0))
    dec.head[2] = conv3x3(dec.head[2].in_channels, image_channels * patch_size * patch_size)
    dec.__class__ = type("Decoder3d", (v22.Decoder3d,), {
        "__module__": v22.__name__, "__qualname__": "Decoder3d", "forward": _upstream_decoder_forward})
    model.patch_size = patch_size
    model.__class__ = type("WanVAE", (v22.WanVAE,), {
        "__module__": v22.__name__, "__qualname__": "WanVAE", "decode": _upstream_decode})
    init_weights_(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def upstream22():
    fast = _upstream_wan22()
    return _upstream_wan22(), fast, install_fast_path(fast)


def test_upstream_wan22_fuses_every_module_the_wing_knows(upstream22):
    _, fast, report = upstream22
    assert report.reason is None and report.skipped == {}
    assert report.fused == _known_modules(fast)
    assert fast._fvd_loop is True


def _lossless_equal_and_high_close(stock, fast, z):
    """Closed gate: ``torch.equal`` to the stock model; open: every module fused, close to it."""
    with torch.inference_mode():
        expected = stock.decode(z)
        with gate_for(fast).opened(False):
            assert torch.equal(fast.decode(z), expected)
        with gates_opened(fast, True) as stats:
            got = fast.decode(z)
    assert stats[0].fallbacks == {} and stats[0].fused_calls > 0
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    return expected


@pytest.mark.parametrize("shape", [(1, 64, 2, 4, 6), (1, 64, 4, 6)], ids=["video", "image"])
def test_upstream_wan22_lossless_and_high(upstream22, shape):
    stock, fast, _ = upstream22
    expected = _lossless_equal_and_high_close(stock, fast, _latent(shape))
    assert expected.shape[:2] == (1, 4) and expected.dim() == len(shape)  # RGBA, 4-D stays 4-D


def test_upstream_wan22_temporal_kernel_3_fuses_too():
    model = _upstream_wan22(temporal_kernel=3, image_channels=3, patch_size=2, z_dim=48)
    report = install_fast_path(model)
    assert report.skipped == {} and report.fused == _known_modules(model)


# Newest upstream vae.WanVAE.decode: 0.33's chunked loop (first latent frame, then two at a time,
# the decoder returning lists of chunks) behind a 4-D branch that decodes the image as one frame.


def _upstream_wan21_decode(self, z):
    if z.ndim == 4:
        return self.decode(z.unsqueeze(2)).squeeze(2)
    calls = 1 + z.shape[2] // 2
    cache = [None] * count_cache_layers(self.decoder) if calls > 1 else None  # noqa: F821
    x = self.conv2(z)
    out = []
    for i in range(calls):
        piece = x[:, :, :1] if i == 0 else x[:, :, 2 * i - 1:2 * i + 1]
        out += self.decoder(piece, feat_cache=cache, feat_idx=[0])
    return torch.cat(out, 2)


@pytest.mark.parametrize("shape", [(1, 16, 3, 4, 6), (1, 16, 4, 6)], ids=["video", "image"])
def test_upstream_wan21_decode_with_images(shape):
    comfy_nodes()
    import comfy.ldm.wan.vae as v21

    from fast_vae_decode.bench.models import _wan_config, init_weights_

    if not hasattr(v21, "count_cache_layers"):
        pytest.skip("this tree's Wan 2.1 decoder is the per-frame one")
    globals().update(count_cache_layers=v21.count_cache_layers)
    cls = type("WanVAE", (v21.WanVAE,), {"__module__": v21.__name__, "__qualname__": "WanVAE",
                                         "decode": _upstream_wan21_decode})
    stock, fast = (init_weights_(cls(**_wan_config("wan21", tiny=True)), 0).eval() for _ in range(2))
    report = install_fast_path(fast)
    assert report.skipped == {} and report.fused == _known_modules(fast) and fast._fvd_loop is True
    expected = _lossless_equal_and_high_close(stock, fast, _latent(shape))
    assert expected.dim() == len(shape)
