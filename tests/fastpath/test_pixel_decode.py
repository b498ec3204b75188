"""The pixel finish on the decoder's device (``fastpath.pixel_finish``) and the ComfyUI decode
that uses it (``nodes.pixel_decode``): the same values as ``VAE.decode`` in every slicing.

Tier 1: ``finish_pixels`` on CPU tensors with staging limits small enough to split items,
frames and rows. Tier 2: the decode loop on ComfyUI VAEs (CPU) against ``VAEDecode``, batch
splits, the out-of-memory retry and what it declines. Tier 3: the staged GPU -> host copy and
the node on the GPU, ``torch.equal`` with ``VAEDecode``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fast_vae_decode.fastpath.pixels import finish as pixel_finish
from support.comfy_env import comfy_nodes, pack_module, requires_comfyui


def _comfy_finish(image):
    # ComfyUI's image process_output, written out: the elementwise steps whose bits must match.
    return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)


def _reference(out):
    return _comfy_finish(out.float().cpu()).movedim(1, -1).contiguous()


def _decoded(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # Beyond [-1, 1] on purpose, so the clamp is exercised on both sides.
    return (torch.randn(shape, generator=g) * 1.5).to(dtype=dtype, device=device)


# (decoder output shape, staging limit in bytes) -- each limit forces a different split.
SLICINGS = [
    ((2, 3, 16, 24), 1 << 20),  # whole items fit: one piece per batch item
    ((1, 3, 16, 24), 3 * 24 * 4 * 5),  # 5 rows per piece, the last piece shorter (16 = 3*5+1)
    ((1, 3, 5, 8, 12), 3 * 8 * 12 * 4 * 2),  # video: 2 frames per piece
    ((2, 3, 3, 8, 12), 3 * 12 * 4 * 3),  # a frame alone is too big: 3 rows of one frame
    ((1, 3, 2, 4, 5), 8),  # smaller than one pixel row: one row per piece, never empty
]


@pytest.mark.parametrize("shape,limit", SLICINGS)
def test_finish_pixels_equals_the_whole_tensor_finish(monkeypatch, shape, limit):
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", limit)
    out = _decoded(shape)
    dest = torch.full((shape[0],) + shape[2:] + (shape[1],), float("nan"))
    pixel_finish.finish_pixels(out, _comfy_finish, dest)
    assert torch.equal(dest, _reference(out))  # every element written (no NaN left), exactly


def test_slices_cover_each_element_once():
    src = torch.arange(3 * 3 * 8 * 12, dtype=torch.float32).reshape(3, 3, 8, 12)
    dest = torch.zeros(3, 8, 12, 3)
    pieces = list(pixel_finish._slices(src, dest, 3 * 12 * 4 * 3))
    assert len(pieces) == 3 * 3  # three frames, each in three 3-row pieces (8 = 3+3+2)
    for s, d in pieces:
        assert d.is_contiguous() and s.shape[0] == 3 and d.shape == s.movedim(0, -1).shape
        d += 1
    assert torch.equal(dest, torch.ones_like(dest))


def test_finish_pixels_rejects_a_destination_it_cannot_fill():
    out = _decoded((1, 3, 4, 4))
    with pytest.raises(ValueError, match="contiguous float32"):
        pixel_finish.finish_pixels(out, _comfy_finish, torch.empty(1, 4, 4, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous float32"):
        pixel_finish.finish_pixels(out, _comfy_finish, torch.empty(1, 3, 4, 4).movedim(1, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staged_copy_from_the_gpu_is_exact(monkeypatch, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    # 33 frames of 96x160 in 2-frame pieces: 17 pieces, so both staging buffers are reused
    # many times and the last piece is a partial one.
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 2 * 3 * 96 * 160 * 4)
    monkeypatch.setattr(pixel_finish, "_STAGING", {})
    out = _decoded((1, 3, 33, 96, 160), dtype=dtype, device="cuda")
    dest = torch.full((1, 33, 96, 160, 3), float("nan"))
    with torch.inference_mode():  # staging made here must serve decodes outside it too
        pixel_finish.finish_pixels(out, _comfy_finish, torch.empty_like(dest))
    pixel_finish.finish_pixels(out, _comfy_finish, dest)
    assert torch.equal(dest, _reference(out))
    assert all(b.is_pinned() for b in pixel_finish._STAGING[torch.cuda.current_device()].buffers)


# --- ComfyUI (tier 2 on the CPU, tier 3 on the GPU) ---------------------------------------

CASES = [
    ("sdxl", (2, 4, 8, 8)),  # batch 2: the loop's batch split is exercised below
    ("wan21", (1, 16, 3, 4, 6)),  # 3 latent frames -> 9 video frames
]


@pytest.fixture(scope="module")
def vaes():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return {arch: comfy_vae(arch, seed=0, tiny=True) for arch, _ in CASES}


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stock(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def _frames(images):
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images


def _record_streams(monkeypatch) -> list[bool]:
    """What each ``FrameStream.complete`` of the loaded pack answered, in order."""
    cls = pack_module("fastpath.pixels.finish").FrameStream
    answers, complete = [], cls.complete

    def recording(self, result):
        answers.append(complete(self, result))
        return answers[-1]

    monkeypatch.setattr(cls, "complete", recording)
    return answers


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.usefixtures("no_interpreter")
@pytest.mark.parametrize("arch,shape", CASES)
def test_device_finish_loop_equals_vae_decode(pack, vaes, monkeypatch, arch, shape):
    """The loop itself, run on the CPU (where ``decode_pixels`` would not choose it), one batch
    item per pass and two frames or rows per piece."""
    import comfy.model_management as mm

    module = pack_module("fastpath.pixels.decode")
    vae, z = vaes[arch], _latent(shape)
    pack_module("fastpath.install").install_fast_path(vae.first_stage_model)  # as the node does
    monkeypatch.setattr(pack_module("fastpath.pixels.finish"), "STAGE_BYTES", 3 * 2 * 48 * 4)
    # Room for one batch item per pass, for both (a batch of 2 in one conv may round differently).
    one_item = vae.memory_used_decode(z.shape, vae.vae_dtype)
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: one_item)
    streams = _record_streams(monkeypatch)
    with torch.inference_mode():
        expected = _stock(vae, z)
        pixels = module._decode_with_device_finish(vae, z)
    assert pixels.is_contiguous() and pixels.dtype == torch.float32
    assert torch.equal(_frames(pixels), expected)
    # Wan 2.1 streams its frames as the loop makes them; an image VAE is finished afterwards.
    assert streams == ([True] if arch == "wan21" else [False, False])


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.usefixtures("no_interpreter")
def test_out_of_memory_hands_the_decode_to_comfyui(pack, vaes, monkeypatch):
    import comfy.model_management as mm

    module = pack_module("fastpath.pixels.decode")
    vae, z = vaes["sdxl"], _latent(CASES[0][1])
    model = vae.first_stage_model
    calls = []

    def decode_once_out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise mm.OOM_EXCEPTION("CUDA out of memory (simulated)")
        return type(model).decode(model, *args, **kwargs)

    with torch.inference_mode():
        expected = _stock(vae, z)
        monkeypatch.setattr(model, "decode", decode_once_out_of_memory)
        monkeypatch.setattr(module, "device_finish_reason", lambda vae, latent: None)
        images = module.decode_pixels(vae, z)
    assert len(calls) >= 2  # the second attempt is ComfyUI's own VAE.decode
    assert torch.equal(images, expected)


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.usefixtures("no_interpreter")
def test_what_the_device_finish_declines(pack, vaes):
    module = pack_module("fastpath.pixels.decode")
    vae = vaes["sdxl"]
    image_latent = _latent((1, 4, 8, 8))
    assert "stay on its device" in module.device_finish_reason(vae, image_latent)  # CPU VAE
    assert "not a comfy.sd.VAE" in module.device_finish_reason(object(), image_latent)
    gpu_like = copy.copy(vae)
    gpu_like.device = torch.device("cuda", 0)
    assert module.device_finish_reason(gpu_like, image_latent) is None
    assert "5-D latent" in module.device_finish_reason(gpu_like, image_latent[:, :, None])
    with torch.inference_mode():  # declined: exactly VAE.decode
        assert torch.equal(module.decode_pixels(vae, image_latent), vae.decode(image_latent))


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.usefixtures("no_interpreter")
def test_a_decode_another_extension_replaced_keeps_running(pack, vaes, monkeypatch):
    """Another pack wrapping ``VAE.decode`` (on the class or one object) changes what a decode
    does; the node must call it, not go around it."""
    import comfy.sd

    module = pack_module("fastpath.pixels.decode")
    gpu_like = copy.copy(vaes["sdxl"])
    gpu_like.device = torch.device("cuda", 0)
    z = _latent((1, 4, 8, 8))
    assert module.device_finish_reason(gpu_like, z) is None
    stock_decode = comfy.sd.VAE.decode
    calls = []

    def wrapped(self, *args, **kwargs):
        calls.append(1)
        return stock_decode(self, *args, **kwargs)

    monkeypatch.setattr(comfy.sd.VAE, "decode", wrapped)
    assert "VAE.decode is replaced (by " in module.device_finish_reason(gpu_like, z)
    monkeypatch.setattr(comfy.sd.VAE, "decode", stock_decode)
    gpu_like.decode = lambda samples: wrapped(gpu_like, samples)
    assert "on the object" in module.device_finish_reason(gpu_like, z)
    cpu_vae = vaes["sdxl"]
    monkeypatch.setattr(comfy.sd.VAE, "decode", wrapped)
    with torch.inference_mode():
        pack["FastVAEDecode"].execute(samples={"samples": z}, vae=cpu_vae, quality="lossless")
    assert calls  # the node went through the wrapper


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.cuda
@pytest.mark.parametrize("arch,shape", CASES)
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_node_on_the_gpu_equals_vae_decode(pack, monkeypatch, arch, shape, quality):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    vae = comfy_vae(arch, seed=0, tiny=True, device="cuda")
    z = _latent(shape)
    module = pack_module("fastpath.pixels.decode")
    assert module.device_finish_reason(vae, z) is None
    # Small pieces, so the staging buffers alternate within one decode.
    monkeypatch.setattr(pack_module("fastpath.pixels.finish"), "STAGE_BYTES", 3 * 2 * 48 * 4)
    streams = _record_streams(monkeypatch)
    with torch.inference_mode():
        expected = _stock(vae, z)
        images = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality).args[0]
    assert images.shape == expected.shape and images.device.type == "cpu"
    assert streams == ([True] if arch == "wan21" else [False])
    if quality == "lossless":
        assert torch.equal(images, expected)
    else:  # how close high is to lossless is judged at real sizes elsewhere; here: the copy
        assert torch.isfinite(images).all() and 0 <= images.min() and images.max() <= 1


@pytest.mark.cuda
def test_staging_follows_the_limit_and_passes_oversized_rows_directly(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    monkeypatch.setattr(pixel_finish, "_STAGING", {})
    out = _decoded((2, 3, 6, 40), device="cuda")
    for limit in (3 * 40 * 4 * 2, 3 * 40 * 4 * 5):  # a later, larger limit gets larger buffers
        monkeypatch.setattr(pixel_finish, "STAGE_BYTES", limit)
        dest = torch.full((2, 6, 40, 3), float("nan"))
        pixel_finish.finish_pixels(out, _comfy_finish, dest)
        assert torch.equal(dest, _reference(out))
        assert pixel_finish._STAGING[torch.cuda.current_device()].buffers[0].numel() == limit // 4
    # Below one pixel (3 values): each pixel goes straight across, no buffer is overrun.
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 8)
    dest = torch.full((2, 6, 40, 3), float("nan"))
    pixel_finish.finish_pixels(out, _comfy_finish, dest)
    assert torch.equal(dest, _reference(out))


# --- streamed frames (FrameStream + the Wan decode loop's frames_ready) --------------------


def _stream_into(dest):
    return pixel_finish.FrameStream(_comfy_finish, lambda out: dest)


def test_frame_stream_finishes_frames_in_order_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 3 * 8 * 12 * 4)  # one frame per piece
    final = _decoded((2, 3, 9, 8, 12))
    out = torch.zeros_like(final)
    dest = torch.full((2, 9, 8, 12, 3), float("nan"))
    stream = _stream_into(dest)
    for start, stop in ((0, 1), (1, 5), (5, 9)):  # Wan's chunks: 1 frame, then 4 at a time
        out[:, :, start:stop] = final[:, :, start:stop]
        stream.frames_ready(out, start, stop)
    assert stream.complete(out)
    assert torch.equal(dest, _reference(final))


@pytest.mark.parametrize("case", ["skipped frames", "another tensor", "not all frames", "never called"])
def test_frame_stream_reports_incomplete_streams(case):
    out = _decoded((1, 3, 5, 4, 4))
    stream = _stream_into(torch.empty(1, 5, 4, 4, 3))
    if case == "skipped frames":
        stream.frames_ready(out, 0, 1)
        stream.frames_ready(out, 2, 5)
    elif case == "another tensor":
        stream.frames_ready(out, 0, 1)
        stream.frames_ready(out.clone(), 1, 5)
    elif case == "not all frames":
        stream.frames_ready(out, 0, 1)
    assert not stream.complete(out)
    stream.close()  # idempotent


def test_wan_loop_hands_over_each_chunk_once_it_is_final():
    from fast_vae_decode.fastpath.families.wan.decode import assemble_frames

    chunks = [torch.full((1, 2, 1 if i == 0 else 4, 3, 3), float(i)) for i in range(4)]
    seen = []

    def ready(out, start, stop):
        seen.append((start, stop, out[:, :, start:stop].clone()))

    out = assemble_frames(lambda i: chunks[i], 4, ready)
    assert [(a, b) for a, b, _ in seen] == [(0, 1), (1, 5), (5, 9), (9, 13)]
    for (a, b, frames), chunk in zip(seen, chunks, strict=True):
        assert torch.equal(frames, chunk) and torch.equal(out[:, :, a:b], chunk)


def test_wan_loop_stops_handing_over_when_it_falls_back_to_concatenating():
    from fast_vae_decode.fastpath.families.wan.decode import assemble_frames

    # The third chunk is larger than planned: from there the loop concatenates, and returns a
    # new tensor, so a stream cannot claim to be complete.
    chunks = [torch.zeros(1, 2, 1, 3, 3), torch.ones(1, 2, 4, 3, 3), torch.ones(1, 2, 6, 3, 3)]
    stream = _stream_into(torch.empty(1, 9, 3, 3, 2))
    calls = []

    def ready(out, start, stop):
        calls.append((start, stop))
        stream.frames_ready(out, start, stop)

    result = assemble_frames(lambda i: chunks[i], 3, ready)
    assert calls == [(0, 1), (1, 5)] and result.shape[2] == 11
    assert not stream.complete(result)


@pytest.mark.cuda
def test_frame_stream_on_the_gpu_overlaps_and_stays_exact(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    # One frame per piece and 4-frame chunks: the 4-buffer ring is reused within every chunk.
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 3 * 96 * 160 * 4)
    monkeypatch.setattr(pixel_finish, "_STAGING", {})
    final = _decoded((1, 3, 33, 96, 160), device="cuda")
    out = torch.empty_like(final)
    dest = torch.full((1, 33, 96, 160, 3), float("nan"))
    stream = _stream_into(dest)
    busy = torch.randn(2048, 2048, device="cuda")
    bounds = [(0, 1)] + [(1 + 4 * k, 5 + 4 * k) for k in range(8)]
    for start, stop in bounds:
        for _ in range(4):  # GPU work queued between chunks, as the next decode step would be
            busy = torch.tanh(busy @ busy)
        out[:, :, start:stop].copy_(final[:, :, start:stop])
        stream.frames_ready(out, start, stop)
    assert stream.complete(out)
    assert torch.equal(dest, _reference(final))
