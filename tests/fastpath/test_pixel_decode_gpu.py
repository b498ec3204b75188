"""The pixel finish on the decoder's device (``fastpath.pixel_finish``) on a GPU: the same
values as ``VAE.decode`` in every slicing.

Tier 3 (``cuda``): the staged GPU -> host copy, the staging limit, and streamed frames
overlapping GPU work, ``torch.equal`` with the whole-tensor finish. ``finish_pixels`` on CPU
tensors is tier 1, in test_pixel_decode.py; the node on the GPU is in
tests/comfyui/test_pixel_decode_comfyui_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath.pixels import finish as pixel_finish
from support.pixel_decode import _comfy_finish, _decoded, _reference, _stream_into


@pytest.mark.cuda
@pytest.mark.parametrize("memmove", [False, True, None], ids=["copy_", "memmove", "by-size"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staged_copy_from_the_gpu_is_exact(monkeypatch, dtype, memmove):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    monkeypatch.setattr(pixel_finish.host_copy, "memmove", memmove)
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


def _frames_on_a_fresh_ring(monkeypatch, frames: int):
    """(decoded 96x160 frames on the GPU, a NaN host destination), with a new staging ring
    whose buffers hold one frame each."""
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 3 * 96 * 160 * 4)
    monkeypatch.setattr(pixel_finish, "_STAGING", {})
    final = _decoded((1, 3, frames, 96, 160), device="cuda")
    return final, torch.full((1, frames, 96, 160, 3), float("nan"))


@pytest.mark.cuda
def test_frame_stream_on_the_gpu_overlaps_and_stays_exact(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    # One frame per piece and 4-frame chunks: the 4-buffer ring is reused within every chunk.
    final, dest = _frames_on_a_fresh_ring(monkeypatch, 33)
    stream = _stream_into(dest)
    assert stream.begin(final.shape, final.dtype, final.device)
    busy = torch.randn(2048, 2048, device="cuda")
    bounds = [(0, 1)] + [(1 + 4 * k, 5 + 4 * k) for k in range(8)]
    for start, stop in bounds:
        for _ in range(4):  # GPU work queued between chunks, as the next decode step would be
            busy = torch.tanh(busy @ busy)
        # A fresh chunk the loop drops at once: its memory must outlive the side stream's reads.
        chunk = final[:, :, start:stop] * 1
        stream.take(chunk, start)
        del chunk
        torch.empty_like(final[:, :, start:stop]).fill_(float("nan"))  # would reuse it if freed
    assert stream.complete(stream.result())
    assert torch.equal(dest, _reference(final))


@pytest.mark.cuda
def test_repeated_frame_streams_reuse_their_side_stream_memory(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tier 3)")
    # The caching allocator keeps freed blocks per stream: with a new side stream per decode,
    # each decode's finished slices took new segments (cudaMalloc) until torch's 32 pooled
    # streams each had their own. Decodes after the first must allocate nothing new.
    final, dest = _frames_on_a_fresh_ring(monkeypatch, 9)
    allocs = []
    for _ in range(4):
        stream = _stream_into(dest)
        assert stream.begin(final.shape, final.dtype, final.device)
        for start, stop in [(0, 1), (1, 5), (5, 9)]:
            stream.take(final[:, :, start:stop] * 1, start)
        assert stream.complete(stream.result())
        torch.cuda.synchronize()
        allocs.append(torch.cuda.memory_stats()["num_device_alloc"])
    assert torch.equal(dest, _reference(final))
    assert allocs[1:] == [allocs[0]] * 3, allocs
