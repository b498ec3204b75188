"""CUDA graphs against torch's own allocator and random generator (tier 3, ``cuda``).

The CPU stand-in in test_cuda_graph.py models torch's pool rule; these check the real thing:
a decoder whose only graph went stale (ComfyUI 0.33's dynamic VRAM moves a VAE's weights
whenever another model loads) captures again, and a capture that fails leaves the device's
default random generator usable (on torch <= 2.11 a failure inside ``capture_begin`` leaves it
in capture mode, and every random op after it raises).
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath import cuda_graph, install

pytest.importorskip("diffusers")
from support.kl_models import _decode, _latent, tiny_vae  # noqa: E402

pytestmark = pytest.mark.cuda


def test_stale_weights_are_captured_again_and_random_ops_still_work():
    model = tiny_vae().to("cuda", torch.bfloat16)
    install.install_fast_path(model)
    z = _latent(device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm-up and eager, capture, replay
        _decode(model, z, is_open=True)
    assert cuda_graph.graph_status(model) == ["replayed"]
    conv = model.decoder.up_blocks[0].resnets[0].conv1
    conv.weight = torch.nn.Parameter(conv.weight * 1.5, requires_grad=False)  # as set_attr_param
    _decode(model, z, is_open=True)  # stale: the graph (the pool's only user) is reset
    assert cuda_graph.graph_status(model) != ["replayed"]
    _decode(model, z, is_open=True)
    assert cuda_graph.graph_status(model) == ["captured"]
    torch.rand(4, device="cuda")  # raised "Offset increment outside graph capture" before
    _decode(model, z, is_open=True)
    assert cuda_graph.graph_status(model) == ["replayed"]


def test_a_capture_into_a_dead_pool_leaves_the_generator_as_it_was():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(1024, device=device)
    pool = torch.cuda.graph_pool_handle()
    graph, out, _ = cuda_graph.BACKEND.capture(lambda t: t * 2, x, pool)
    graph.reset()  # the pool's only user: its handle is dead from here
    del out
    generator = torch.cuda.default_generators[device.index]
    offset = generator.get_offset()
    expected = torch.rand(8, device="cuda")  # what the stream gives from this offset
    generator.set_offset(offset)
    try:
        cuda_graph.BACKEND.capture(lambda t: t + 1, x, pool)
    except RuntimeError:
        pass  # torch <= 2.11 refuses the handle; newer ones may take it
    assert generator.get_offset() == offset
    assert torch.equal(torch.rand(8, device="cuda"), expected)
