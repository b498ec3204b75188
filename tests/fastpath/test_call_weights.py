"""``comfyui.weights.call_tensors``: the one-lookup form of ``fetch_reason`` + ``weight_of`` +
``is_stable`` that a CUDA-graph replay's weight fingerprint uses (tier 1, no ComfyUI: plain
modules, and one that ComfyUI's low-VRAM mode marks but that is not one of ComfyUI's ops)."""
from __future__ import annotations

import torch

from fast_vae_decode.fastpath.comfyui.weights import (
    LOW_VRAM,
    call_tensors,
    fetch_reason,
    is_stable,
    weight_of,
    weights_for_call,
)


def _three_lookups(module, x):
    reason = fetch_reason(module, x)
    if reason is not None:
        return reason, (), False
    return None, tuple(weight_of(module, n) for n in module._parameters), is_stable(module)


def _same(a, b):
    return a[0] == b[0] and a[2] == b[2] and len(a[1]) == len(b[1]) and all(
        s is t for s, t in zip(a[1], b[1], strict=True))


def test_call_tensors_is_the_three_lookups_in_and_out_of_a_scope():
    x = torch.zeros(1, 3, 4, 4)
    conv, norm = torch.nn.Conv2d(3, 4, 3), torch.nn.GroupNorm(1, 3)
    marked = torch.nn.Conv2d(3, 4, 1, bias=False)
    marked.comfy_cast_weights = True  # low-VRAM's mark on a module that is not ComfyUI's op
    for module in (conv, norm, marked):
        assert _same(call_tensors(module, x), _three_lookups(module, x))
        with weights_for_call():
            got = call_tensors(module, x)
            assert _same(got, _three_lookups(module, x))
    assert call_tensors(conv, x) == (None, (conv.weight, conv.bias), True)
    assert call_tensors(marked, x) == (LOW_VRAM, (), False)
    with weights_for_call():
        assert call_tensors(marked, x) == (LOW_VRAM, (), False)
