"""Tier 1: the ComfyUI room's knowledge of Wan code (``fastpath/comfyui/wan_code.py``) on plain
stand-ins: both causal-conv padding shapes, refusals, and fingerprints of stock methods."""
from __future__ import annotations

import torch

from fast_vae_decode.fastpath.comfyui import wan_code


def _conv(padding, own=(0, 0, 0)):
    conv = torch.nn.Conv3d(2, 2, 3)
    conv._padding = padding
    conv.padding = own
    return conv


def test_causal_padding_reads_both_shapes():
    assert wan_code.causal_padding(_conv((1, 1, 1, 1, 2, 0))) == (2, 1, 1)  # 0.8 / diffusers
    assert wan_code.causal_padding(_conv(2, (0, 1, 1))) == (2, 1, 1)  # 0.33+
    assert wan_code.stock_pads_in_two_copies(_conv((1, 1, 1, 1, 2, 0)))
    assert not wan_code.stock_pads_in_two_copies(_conv(2, (0, 1, 1)))


def test_causal_padding_refuses_what_it_does_not_know():
    assert isinstance(wan_code.causal_padding(_conv((1, 1, 1, 1, 2, 0), (0, 1, 1))), str)
    assert isinstance(wan_code.causal_padding(_conv(2, (1, 1, 1))), str)  # conv pads time itself
    assert isinstance(wan_code.causal_padding(_conv((1, 2, 1, 1, 2, 0))), str)  # asymmetric
    assert wan_code.causal_padding(_conv(None)) == "conv has no causal padding"
    assert isinstance(wan_code.causal_padding(_conv(True, (0, 1, 1))), str)


def test_method_code_by_fingerprint():
    def forward(self, x, feat_cache=None, feat_idx=[0], final=False):  # noqa: B006
        return self.residual(x) + self.shortcut(x)

    cls = type("ResidualBlock", (torch.nn.Module,), {"__module__": wan_code.V21, "forward": forward})
    assert wan_code.fingerprinted(cls)
    assert wan_code.method_code(cls(), "forward") == (
        "unrecognised comfy.ldm.wan.vae.ResidualBlock.forward (a newer version?)")
    plain = type("ResidualBlock", (torch.nn.Module,), {"forward": forward})
    assert not wan_code.fingerprinted(plain)
    assert wan_code.method_code(plain(), "forward").startswith("no known ")
