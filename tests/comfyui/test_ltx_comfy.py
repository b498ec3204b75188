"""Tier 2: the LTX family on ComfyUI's own ``VideoVAE`` classes, on every tree it knows.

``comfy.sd.VAE`` built from a seeded random state dict of ComfyUI's own ``VideoVAE`` (a narrow
version of its default LTX-2 structure, given as checkpoint metadata: ``bench.models``),
decoded through ComfyUI's ``VAEDecode``. The decode draws noise (``torch.randn_like``, timestep
conditioning), so every decode is preceded by ``torch.manual_seed``. The Triton interpreter
stays on, so ``high`` runs the fused kernels here, on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.gate import gates_opened
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.fastpath.swap import is_swapped
from support.comfy_env import comfy_nodes, requires_comfyui
from support.gated import stock_and_gated

pytestmark = [requires_comfyui, pytest.mark.comfyui]

SEED = 7
# latent shapes: (batch, 128, frames, height, width); outputs 1 + 8 * (frames - 1) frames,
# 32x the latent size (the real ratios). Batch 1 only: ComfyUI's timestep-conditioned
# decoder embeds one timestep and cannot view it per sample (stock raises for batch 2).
SHAPES = [(1, 128, 3, 2, 3), (1, 128, 1, 2, 2), (1, 128, 2, 3, 2)]
IDS = ["x".join(map(str, s[2:])) + f"-b{s[0]}" for s in SHAPES]
TILED_INPUTS = dict(tile_size=128, overlap=32, temporal_size=16, temporal_overlap=8)


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _seeded(fn, *args, **kwargs):
    torch.manual_seed(SEED)
    return fn(*args, **kwargs)


def _decode(vae, z):
    return _seeded(comfy_nodes().VAEDecode().decode, vae, {"samples": z})[0]


def _vae():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return comfy_vae("ltx2", seed=0, tiny=True)


@pytest.fixture(scope="module")
def vaes():
    """A stock VAE and one with the fast path installed by this test copy (same weights)."""
    fast = _vae()
    return _vae(), fast, install_fast_path(fast.first_stage_model)


@pytest.fixture(scope="module")
def node_vaes():
    """Two VAEs only the pack's own (ComfyUI-loaded) copy installs into, through its node."""
    return _vae(), _vae()


def _chunked_tree():
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as cva

    return hasattr(cva, "get_max_chunk_size")


def test_installs_into_comfyuis_video_vae(vaes):
    _, vae, report = vaes
    model = vae.first_stage_model
    assert type(model).__name__ == "VideoVAE" and model.timestep_conditioning
    assert report.family == "ltx" and report.reason is None and report.skipped == {}
    kinds = ("ResnetBlock3D]", "CausalConv3d]", "DepthToSpaceUpsample]")
    fused = [m for m in model.decoder.modules() if type(m).__name__.endswith(kinds)]
    assert fused and all(is_swapped(m) for m in model.decoder.modules()
                         if type(m).__name__ in ("ResnetBlock3D", "CausalConv3d", "DepthToSpaceUpsample"))
    assert is_swapped(model.decoder.conv_norm_out)
    assert not any(is_swapped(m) for m in model.encoder.modules())


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_lossless_equals_vae_decode(vaes, shape):
    stock, vae, _ = vaes
    z = _latent(shape)
    expected, got, _ = stock_and_gated(_decode, stock, vae, z, False)
    assert expected.shape[0] == shape[0] * (8 * shape[2] - 7)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_high_close_to_stock(vaes, shape):
    stock, vae, _ = vaes
    z = _latent(shape)
    expected, got, stats = stock_and_gated(_decode, stock, vae, z, True)
    assert stats.fallbacks == {} and stats.fused_calls > 0
    assert torch.isfinite(got).all()
    # fp32 on the CPU: summation orders differ at ~1e-7 relative per layer; images in [0, 1].
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_noise_is_drawn_as_stock(vaes):
    """Both qualities leave the generator exactly where stock leaves it."""
    stock, vae, _ = vaes
    z = _latent(SHAPES[0])
    after = []
    with torch.inference_mode():
        for model, is_open in ((stock, False), (vae, False), (vae, True)):
            with gates_opened(model, is_open):
                _decode(model, z)
            after.append(torch.randn(8))
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])


@pytest.mark.parametrize("chunk_bytes", [200_000, 50_000])
def test_chunked_decode_high_close_and_lossless_exact(vaes, monkeypatch, chunk_bytes):
    """0.33+: the decoder splits activations into chunks of frames and the modules carry frame
    state between them; the fused modules must keep that state as stock does."""
    if not _chunked_tree():
        pytest.skip("this tree's LTX decoder does not chunk")
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as cva

    monkeypatch.setattr(cva, "get_max_chunk_size", lambda device: chunk_bytes)
    stock, vae, _ = vaes
    z = _latent((1, 128, 3, 2, 3), seed=2)
    with torch.inference_mode():
        expected = _decode(stock, z)
        with gates_opened(vae, False):
            lossless = _decode(vae, z)
        with gates_opened(vae, True) as stats:
            high = _decode(vae, z)
    assert torch.equal(lossless, expected)
    assert stats[0].fallbacks == {} and stats[0].fused_calls > 0
    torch.testing.assert_close(high, expected, rtol=1e-4, atol=1e-4)


def test_pixel_output_takes_frames_as_the_decoder_writes_them(vaes, monkeypatch):
    """0.33+: a fused decode writes into the pack's output buffer, and the head conv says when
    each chunk is written, so the finished pixels leave while later chunks decode: the same
    pixels as ComfyUI's own decode of the same fused modules. Older trees write no buffer."""
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as cva

    from fast_vae_decode.fastpath.pixels import decode as pixel_decode
    from fast_vae_decode.fastpath.pixels import finish as pixel_finish

    _, vae, _ = vaes
    assert vae.first_stage_model.decoder.conv_out._fvd_writes_output == _chunked_tree()
    if not _chunked_tree():
        pytest.skip("this tree's LTX decoder writes no output buffer")
    monkeypatch.setattr(cva, "get_max_chunk_size", lambda device: 50_000)
    starts, answers = [], []
    take, complete = pixel_finish.FrameStream.take, pixel_finish.FrameStream.complete
    monkeypatch.setattr(pixel_finish.FrameStream, "take",
                        lambda self, chunk, start: (starts.append(start), take(self, chunk, start)))
    monkeypatch.setattr(pixel_finish.FrameStream, "complete",
                        lambda self, out: answers.append(complete(self, out)) or answers[-1])
    z = _latent((1, 128, 3, 2, 3), seed=2)
    with torch.inference_mode(), gates_opened(vae, True):
        expected = _decode(vae, z)
        pixels = _seeded(pixel_decode._decode_with_device_finish, vae, z)
    assert answers == [True] and len(starts) > 2 and starts == sorted(starts)
    assert torch.equal(pixels.reshape(expected.shape), expected)


def test_lossless_decode_leaves_the_output_to_comfyui(vaes, monkeypatch):
    """0.33+: a stock-module decode gets no GPU output buffer (its peak has no room for one),
    so ComfyUI's own ``VAE.decode`` writes the frames to host memory, as stock."""
    if not _chunked_tree():
        pytest.skip("this tree's LTX decoder writes no output buffer")
    from fast_vae_decode.fastpath.pixels import decode as pixel_decode

    stock, vae, _ = vaes
    monkeypatch.setattr(pixel_decode, "device_finish_reason", lambda vae, latent: None)
    monkeypatch.setattr(pixel_decode, "_decode_with_device_finish",
                        lambda *args: pytest.fail("the pack's own output loop ran"))
    z = _latent((1, 128, 2, 2, 3), seed=4)
    with torch.inference_mode():
        expected = _decode(stock, z)
        with gates_opened(vae, False):
            images = _seeded(pixel_decode.decode_pixels, vae, z)
    assert torch.equal(images.reshape(expected.shape), expected)


def test_node_lossless_exact_and_high_all_fused(pack, node_vaes):
    stock, vae = node_vaes
    z = _latent(SHAPES[0])
    with torch.inference_mode():
        expected = _decode(stock, z)
        lossless = _seeded(pack["FastVAEDecode"].execute, samples={"samples": z}, vae=vae,
                           quality="lossless")
        high = _seeded(pack["FastVAEDecode"].execute, samples={"samples": z}, vae=vae, quality="high")
    assert torch.equal(lossless.args[0], expected)
    text = high.ui["text"][0]
    assert text.startswith("high: ") and "fused modules" in text and "stock calls" not in text, text
    torch.testing.assert_close(high.args[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_tiled_node_matches_vae_decode_tiled(pack, node_vaes, quality):
    """ComfyUI's tiled decode, temporal tiles included, per tile on the chosen path."""
    stock, vae = node_vaes
    z = _latent((1, 128, 4, 3, 5), seed=3)
    with torch.inference_mode():
        expected = _seeded(comfy_nodes().VAEDecodeTiled().decode, stock, {"samples": z},
                           **TILED_INPUTS)[0]
        out = _seeded(pack["FastVAEDecodeTiled"].execute, samples={"samples": z}, vae=vae,
                      quality=quality, **TILED_INPUTS)
    assert out.args[0].shape == expected.shape
    if quality == "lossless":
        assert torch.equal(out.args[0], expected)
    else:
        assert "stock calls" not in out.ui["text"][0], out.ui["text"][0]
        torch.testing.assert_close(out.args[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("latent_frames", [16, 31])  # 121 and 241 video frames
def test_tiled_node_decodes_a_long_video_a_temporal_tile_at_a_time(pack, node_vaes, monkeypatch,
                                                                   latent_frames):
    """The working set of a long tiled decode is one temporal tile, whatever the length: no
    decode of the fast path's sees more latent frames than ComfyUI's tile (so GPU memory does
    not grow with the frames), and the result is ComfyUI's own tiled decode (high, all fused)."""
    stock, vae = node_vaes
    model = vae.first_stage_model
    seen, decode = [], type(model).decode
    monkeypatch.setattr(model, "decode", lambda z, *a, **k: (seen.append(z.shape[2]), decode(model, z, *a, **k))[1],
                        raising=False)
    z = _latent((1, 128, latent_frames, 2, 2), seed=5)
    inputs = dict(TILED_INPUTS, temporal_size=64, temporal_overlap=8)
    with torch.inference_mode():
        expected = _seeded(comfy_nodes().VAEDecodeTiled().decode, stock, {"samples": z}, **inputs)[0]
        out = _seeded(pack["FastVAEDecodeTiled"].execute, samples={"samples": z}, vae=vae,
                      quality="high", **inputs)
    assert out.args[0].shape == expected.shape and expected.shape[0] == 1 + 8 * (latent_frames - 1)
    assert "stock calls" not in out.ui["text"][0], out.ui["text"][0]
    assert len(seen) > 1 and max(seen) <= 64 // 8 + 1  # a tile's latent frames, never the video's
    torch.testing.assert_close(out.args[0], expected, rtol=1e-4, atol=1e-4)


def test_diffusion_decoder_fails_closed():
    """LTX 2.4/2.5's ``CausalDiffusionVAE`` is recognised and left stock with its reason."""
    comfy_nodes()
    na = pytest.importorskip("comfy.ldm.lightricks.vae.na_diffusion_decoder")
    with torch.device("meta"):  # the real widths, no memory
        model = na.CausalDiffusionVAE()
    report = install_fast_path(model)
    assert report.family == "ltx" and report.fused == 0
    assert "CausalDiffusionVAE" in report.reason and "not supported" in report.reason
    assert not any(is_swapped(m) for m in model.modules())


def test_a_block_failing_halfway_leaves_the_frame_state_alone(vaes, monkeypatch):
    """The stock retry after an exception must find the chunk state the stock path left: the
    fast path writes ``temporal_cache_state`` only once it cannot fail any more."""
    if not _chunked_tree():
        pytest.skip("this tree's LTX modules keep no frame state")
    from fast_vae_decode.fastpath.families.ltx import modules
    from fast_vae_decode.fastpath.families.ltx.ops import thread_key

    _, vae, _ = vaes
    block = vae.first_stage_model.decoder.up_blocks[0].res_blocks[0]
    x = torch.randn(1, block.in_channels, 3, 2, 3).contiguous(memory_format=torch.channels_last_3d)
    timestep = torch.zeros(1, 4 * block.in_channels, 1, 1, 1)
    key = thread_key()
    owners = [block, block.conv1, block.conv2]
    for m in owners:
        m.temporal_cache_state.pop(key, None)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure after both convs")

    monkeypatch.setattr(modules, "exchange_add", broken)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="simulated"):
        block.fast_forward(x, causal=False, timestep=timestep)
    assert all(key not in m.temporal_cache_state for m in owners)
    monkeypatch.undo()
    with torch.inference_mode():
        block.fast_forward(x, causal=False, timestep=timestep)
    assert all(key in m.temporal_cache_state for m in owners)  # a finished call does keep state
    for m in owners:
        m.temporal_cache_state.pop(key, None)


def _config_vaes(name: str):
    from support import ltx_models

    comfy_nodes()
    config = getattr(ltx_models, name)
    fast = ltx_models.ltx_vae(config)
    return ltx_models.ltx_vae(config), fast, install_fast_path(fast.first_stage_model)


@pytest.mark.parametrize("name", ["NOISE_AND_SHORTCUT", "UNCONDITIONED_CAUSAL_ZEROS"])
def test_other_decoder_configurations(name):
    """Noise-injecting and channel-changing blocks (LTX-Video 0.9.x); an unconditioned causal
    decoder with zero padding: fused, lossless exact, high close, the generator left where
    stock leaves it."""
    stock, vae, report = _config_vaes(name)
    assert report.family == "ltx" and report.skipped == {} and report.reason is None
    blocks = [m for m in vae.first_stage_model.decoder.modules() if type(m).__name__.endswith("ResnetBlock3D]")]
    if name == "NOISE_AND_SHORTCUT":
        assert any(b.inject_noise for b in blocks) and any(b.in_channels != b.out_channels for b in blocks)
    z = _latent((1, 128, 2, 2, 3), seed=4)
    after = []
    with torch.inference_mode():
        expected = _decode(stock, z)
        after.append(torch.randn(8))
        with gates_opened(vae, False):
            lossless = _decode(vae, z)
        after.append(torch.randn(8))
        with gates_opened(vae, True) as stats:
            high = _decode(vae, z)
        after.append(torch.randn(8))
    assert torch.equal(lossless, expected)
    assert stats[0].fallbacks == {} and stats[0].fused_calls > 0
    # the same noise, drawn in the same order: high differs from stock by roundings only
    torch.testing.assert_close(high, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])


def test_per_conv_benchmark_records_the_fused_decodes_convs():
    """``convs`` takes LTX-2's shapes from one fused decode on ComfyUI's model: every conv the
    fused path ran, as it ran it (reflect borders in the input, so no conv padding)."""
    from fast_vae_decode.bench import convs
    from fast_vae_decode.bench.cases import CASES

    case = CASES["tiny-ltx2"]
    decoder = _vae().first_stage_model.decoder
    counts = convs.collect_conv_shapes([case], comfyui=True)[case.name]
    shapes = list(counts)
    assert {s.route for s in shapes} == {"conv3d"}
    (conv_in,) = [s for s in shapes if s.kind == "conv_in"]
    (head,) = [s for s in shapes if s.kind == "head"]
    assert counts[conv_in] == 1 and counts[head] == 1
    assert conv_in.cout == decoder.conv_in.conv.out_channels and conv_in.input[1] == 128
    assert head.cout == decoder.conv_out.conv.out_channels
    assert conv_in.input[3:] == tuple(n + 2 for n in case.latent_shape[3:])  # reflect border
    assert all(s.padding == (0, 0, 0) for s in shapes)
    blocks = [m for m in decoder.modules() if type(m).__name__ == "ResnetBlock3D"]
    assert sum(n for s, n in counts.items() if s.kind == "causal 3x3x3") >= 2 * len(blocks)
    assert any(s.kind == "upsample" for s in shapes)  # the depth-to-space convs widen
