"""Helpers shared by the pixel-finish tests (tests/fastpath/test_pixel_decode.py, tier 1, and
test_pixel_decode_gpu.py, tier 3) and the ComfyUI decode tests (tests/comfyui/
test_pixel_decode_comfyui.py, tier 2, and test_pixel_decode_comfyui_gpu.py, tier 3).

The ComfyUI helpers (``CASES`` onwards) need ``COMFYUI_PATH`` only when called.
"""
from __future__ import annotations

import torch

from fast_vae_decode.fastpath.pixels import finish as pixel_finish
from support.comfy_env import comfy_nodes, pack_module

# --- the pixel finish ----------------------------------------------------------------------


def _comfy_finish(image):
    # ComfyUI's image process_output, written out: the elementwise steps whose bits must match.
    return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)


def _reference(out):
    return _comfy_finish(out.float().cpu()).movedim(1, -1).contiguous()


def _decoded(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # Beyond [-1, 1] on purpose, so the clamp is exercised on both sides.
    return (torch.randn(shape, generator=g) * 1.5).to(dtype=dtype, device=device)


def _stream_into(dest):
    return pixel_finish.FrameStream(_comfy_finish, lambda out: dest)


# --- ComfyUI --------------------------------------------------------------------------------

CASES = [
    ("sdxl", (2, 4, 8, 8)),  # batch 2: the loop's batch split is exercised below
    # 4 latent frames -> 13 video frames; two decoder calls even with the first frame joined
    # to the next chunk (0.33: 3 + 1), so the frames still stream to the host
    ("wan21", (1, 16, 4, 4, 6)),
    ("wan22", (1, 48, 3, 4, 6)),  # streamed too: each chunk unpatchified on its own
]


def _latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stock(vae, z):
    return comfy_nodes().VAEDecode().decode(vae, {"samples": z})[0]


def _record_streams(monkeypatch) -> list[bool]:
    """What each ``FrameStream.complete`` of the loaded pack answered, in order."""
    cls = pack_module("fastpath.pixels.finish").FrameStream
    answers, complete = [], cls.complete

    def recording(self, result):
        answers.append(complete(self, result))
        return answers[-1]

    monkeypatch.setattr(cls, "complete", recording)
    return answers
