"""The ComfyUI decode that uses the pixel finish on the decoder's device (``nodes.pixel_decode``)
on a GPU.

Tier 3 (``cuda`` and ``COMFYUI_PATH``): the node on the GPU, ``torch.equal`` with
``VAEDecode``. (The decode loop on the CPU is tier 2, in test_pixel_decode_comfyui.py; the
staged GPU -> host copy is in tests/fastpath/test_pixel_decode_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from support.comfy_env import comfy_nodes, pack_module, requires_comfyui
from support.pixel_decode import CASES, _latent, _record_streams, _stock


@requires_comfyui
@pytest.mark.comfyui
@pytest.mark.cuda
@pytest.mark.parametrize("arch,shape", CASES)
@pytest.mark.parametrize("quality", ["lossless", "high"])
# bench --host-copies: "auto" the pack's defaults (latent cast on the GPU, memmove copy-out for
# these small outputs), "pooled" both by torch on the host, "single" one memmove; lossless must
# stay torch.equal with VAEDecode, which casts the latent on the host.
@pytest.mark.parametrize("host_copies", ["auto", "pooled", "single"])
def test_node_on_the_gpu_equals_vae_decode(pack, monkeypatch, arch, shape, quality, host_copies):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    from fast_vae_decode.bench.models import comfy_vae

    comfy_nodes()
    vae = comfy_vae(arch, seed=0, tiny=True, device="cuda")
    z = _latent(shape)
    module = pack_module("fastpath.pixels.decode")
    if host_copies != "auto":
        single = host_copies == "single"
        monkeypatch.setattr(module.pixel_settings, "cast_latent_on_device", single)
        monkeypatch.setattr(pack_module("fastpath.pixels.finish").host_copy, "memmove", single)
        monkeypatch.setattr(pack_module("fastpath.pixels.finish").host_copy, "parts",
                            1 if single else 4)
    assert module.device_finish_reason(vae, z) is None
    # Small pieces, so the staging buffers alternate within one decode.
    monkeypatch.setattr(pack_module("fastpath.pixels.finish"), "STAGE_BYTES", 3 * 2 * 48 * 4)
    streams = _record_streams(monkeypatch)
    with torch.inference_mode():
        expected = _stock(vae, z)
        images = pack["FastVAEDecode"].execute(samples={"samples": z}, vae=vae, quality=quality).args[0]
    assert images.shape == expected.shape and images.device.type == "cpu"
    assert streams == ([True] if arch.startswith("wan") else [False])
    if quality == "lossless":
        assert torch.equal(images, expected)
    else:  # how close high is to lossless is judged at real sizes elsewhere; here: the copy
        assert torch.isfinite(images).all() and 0 <= images.min() and images.max() <= 1
