"""The ComfyUI decode that uses the pixel finish on the decoder's device (``nodes.pixel_decode``):
the same values as ``VAE.decode``.

Tier 2: the decode loop on ComfyUI VAEs (CPU) against ``VAEDecode``, batch splits, the
out-of-memory retry and what it declines. (The pixel finish itself is tier 1, in
tests/fastpath/test_pixel_decode.py; the node on the GPU is tier 3, in
test_pixel_decode_comfyui_gpu.py.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui
from support.pixel_decode import CASES, _latent, _record_streams, _stock


@pytest.fixture(scope="module")
def vaes():
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    return {arch: comfy_vae(arch, seed=0, tiny=True) for arch, _ in CASES}


def _frames(images):
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images


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
    # Wan streams its frames as the loop makes them; an image VAE is finished afterwards.
    assert streams == ([True] if arch.startswith("wan") else [False, False])


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.usefixtures("no_interpreter")
def test_batch_split_asks_for_free_memory_where_vae_decode_does(pack, vaes, monkeypatch):
    """Torch's free memory has room for one item a pass, the patcher's (0.33 and newer: with
    what dynamic VRAM could evict) for the whole batch: the loop splits the batch as the tree's
    own ``VAE.decode`` does, pass for pass, and stays bit-exact."""
    import comfy.model_management as mm

    module = pack_module("fastpath.pixels.decode")
    vae, z = vaes["sdxl"], _latent(CASES[0][1])
    model = vae.first_stage_model
    pack_module("fastpath.install").install_fast_path(model)  # as the node does
    one_item = vae.memory_used_decode(z.shape, vae.vae_dtype)
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: one_item)
    asks_patcher = hasattr(type(vae.patcher), "get_free_memory")
    if asks_patcher:
        monkeypatch.setattr(type(vae.patcher), "get_free_memory", lambda self, device: 2 * one_item)
    batches = []

    def recording(*args, **kwargs):
        batches.append(args[0].shape[0])
        return type(model).decode(model, *args, **kwargs)

    monkeypatch.setattr(model, "decode", recording)
    with torch.inference_mode():
        expected = _stock(vae, z)
        stock_batches, batches[:] = list(batches), []
        pixels = module._decode_with_device_finish(vae, z)
    assert stock_batches == ([2] if asks_patcher else [1, 1])
    assert batches == stock_batches
    assert torch.equal(pixels, expected)


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
    reliable = copy.copy(gpu_like)
    reliable.first_stage_model = copy.copy(vae.first_stage_model)
    reliable.first_stage_model.comfy_decode_estimate_is_reliable = True  # newest trees tile on it
    assert "decides tiling" in module.device_finish_reason(reliable, image_latent)
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
@pytest.mark.usefixtures("no_interpreter")
def test_device_finish_takes_a_joined_first_call(pack, vaes, monkeypatch):
    """With the first latent frame joined to the next chunk (``join_first``, gate open), the
    frames streamed as the loop makes them are the loop's whole output (the output is planned
    from the frames of the joined first call and of the next one)."""
    module = pack_module("fastpath.pixels.decode")
    wan_settings = pack_module("fastpath.families.wan.settings").settings
    gates = pack_module("fastpath.gate")
    vae, z = vaes["wan21"], _latent((1, 16, 4, 4, 6))
    pack_module("fastpath.install").install_fast_path(vae.first_stage_model)
    monkeypatch.setattr(wan_settings, "join_first_chunk", True)
    monkeypatch.setattr(wan_settings, "join_per_frame", True)  # 0.8's loop
    # The loop's plan alone: joined although no kernel runs on this CPU (the modules fall back).
    monkeypatch.setattr(pack_module("fastpath.families.wan.join_first"),
                        "triton_unavailable_reason", lambda x: None)
    calls = []
    hook = vae.first_stage_model.decoder.register_forward_pre_hook(
        lambda m, a: calls.append(a[0].shape[2]))
    streams = _record_streams(monkeypatch)
    try:
        with torch.inference_mode(), gates.gates_opened(vae, True):
            expected = vae.decode(z)
            joined = list(calls)
            pixels = module._decode_with_device_finish(vae, z)
    finally:
        hook.remove()
    assert joined[0] > 1 and calls == joined + joined  # both decodes joined the first frame
    assert streams == [True]
    assert torch.equal(_frames(pixels), _frames(expected))
