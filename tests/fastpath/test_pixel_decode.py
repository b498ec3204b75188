"""The pixel finish on the decoder's device (``fastpath.pixel_finish``): the same values as
``VAE.decode`` in every slicing.

Tier 1: ``finish_pixels`` on CPU tensors with staging limits small enough to split items,
frames and rows, and streamed frames. (Tier 3, the staged GPU -> host copy, is in
test_pixel_decode_gpu.py; the ComfyUI decode that uses the finish, ``nodes.pixel_decode``, is
tier 2 in tests/comfyui/test_pixel_decode_comfyui.py and tier 3 in
tests/comfyui/test_pixel_decode_comfyui_gpu.py.)
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

from fast_vae_decode.fastpath.pixels import finish as pixel_finish
from support.pixel_decode import _comfy_finish, _decoded, _reference, _stream_into

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


# --- streamed frames (FrameStream as the Wan decode loop's frame sink) -----------------------


def test_frame_stream_finishes_frames_in_order_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 3 * 8 * 12 * 4)  # one frame per piece
    final = _decoded((2, 3, 9, 8, 12))
    dest = torch.full((2, 9, 8, 12, 3), float("nan"))
    stream = _stream_into(dest)
    assert stream.begin(final.shape, final.dtype, final.device)
    for start, stop in ((0, 1), (1, 5), (5, 9)):  # Wan's chunks: 1 frame, then 4 at a time
        stream.take(final[:, :, start:stop].clone(), start)
    assert stream.complete(stream.result())
    assert torch.equal(dest, _reference(final))


def test_frame_streams_of_one_ring_copy_on_one_side_stream(monkeypatch):
    # The caching allocator keeps freed blocks per stream: a new side stream per decode put
    # every decode's finished slices in new segments. Three decodes through one ring: one
    # stream, made once. (No CUDA here: the ring and the copy thread are stand-ins.)
    made, used = [], []

    class Stream:
        def __init__(self, device=None):
            made.append(device)

    class CopyThread:
        def __init__(self, copier, device=None):
            used.append(copier.stream)

        def flush(self):
            pass

    ring = pixel_finish._Staging.__new__(pixel_finish._Staging)  # pinned buffers need CUDA
    ring.buffers, ring.lock, ring.stream = [torch.empty(8)] * pixel_finish.RING, threading.Lock(), None
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(pixel_finish, "_staging", lambda device, elements: ring)
    monkeypatch.setattr(pixel_finish, "_CopyThread", CopyThread)
    for _ in range(3):
        dest = torch.empty(1, 2, 4, 4, 3)
        stream = _stream_into(dest)
        stream.dest = dest
        stream._open(torch.device("cuda", 0))
        assert stream._copier is not None
        stream.close()
    assert made == [torch.device("cuda", 0)]
    assert len(used) == 3 and all(s is used[0] for s in used)


@pytest.mark.parametrize("case", ["skipped frames", "another shape", "past the end"])
def test_frame_stream_refuses_frames_it_cannot_place(case):
    from fast_vae_decode.fastpath.pixels.frames import FramesLost

    out = _decoded((1, 3, 5, 4, 4))
    stream = _stream_into(torch.empty(1, 5, 4, 4, 3))
    assert stream.begin(out.shape, out.dtype, out.device)
    stream.take(out[:, :, :1], 0)
    with pytest.raises(FramesLost):
        if case == "skipped frames":
            stream.take(out[:, :, 2:5], 2)
        elif case == "another shape":
            stream.take(out[:, :2, 1:5], 1)
        else:
            stream.take(torch.cat([out[:, :, 1:], out[:, :, :1]], 2), 1)
    assert not stream.complete(stream.result())  # not every frame came
    stream.close()  # idempotent


def test_frame_stream_is_not_complete_for_another_result():
    out = _decoded((1, 3, 5, 4, 4))
    stream = _stream_into(torch.empty(1, 5, 4, 4, 3))
    assert not stream.complete(out)  # never began
    assert not _stream_into(torch.empty(1, 5, 4, 4, 3)).begin((1, 3, 5, 4), out.dtype, out.device)


def test_wan_loop_hands_over_each_chunk_and_keeps_no_output():
    from fast_vae_decode.fastpath.families.wan.decode import assemble_chunk_lists

    chunks = [torch.full((1, 2, 1 if i == 0 else 4, 3, 3), float(i)) for i in range(4)]
    dest = torch.full((1, 13, 3, 3, 2), float("nan"))
    seen = []

    class Recording(pixel_finish.FrameStream):
        def take(self, chunk, start):
            seen.append((start, chunk))
            super().take(chunk, start)

    stream = Recording(lambda x: x, lambda out: dest)
    result = assemble_chunk_lists(lambda i: [chunks[i]], [1] * 4, stream)
    assert result.is_meta and stream.complete(result)  # no whole output was allocated
    assert [a for a, _ in seen] == [0, 1, 5, 9]
    assert all(chunk is c for (_, chunk), c in zip(seen, chunks, strict=True))  # no copies
    assert torch.equal(dest, torch.cat(chunks, 2).movedim(1, -1))


def test_wan_loop_without_a_sink_assembles_the_stock_output():
    from fast_vae_decode.fastpath.families.wan.decode import assemble_chunk_lists

    chunks = [torch.full((1, 2, 1 if i == 0 else 4, 3, 3), float(i)) for i in range(4)]
    declined = _stream_into(torch.empty(1, 13, 3, 3, 2))
    declined.begin = lambda *a: False
    for sink in (None, declined):
        assert torch.equal(assemble_chunk_lists(lambda i: [chunks[i]], [1] * 4, sink), torch.cat(chunks, 2))


def test_wan_loop_with_a_chunk_off_plan_says_its_frames_are_lost():
    from fast_vae_decode.fastpath.families.wan.decode import assemble_chunk_lists
    from fast_vae_decode.fastpath.pixels.frames import FramesLost

    # The third chunk is larger than planned: without a sink the loop concatenates (the stock
    # result); a sink already holds the first frames, so the caller must decode again.
    chunks = [torch.zeros(1, 2, 1, 3, 3), torch.ones(1, 2, 4, 3, 3), torch.ones(1, 2, 6, 3, 3)]
    assert assemble_chunk_lists(lambda i: [chunks[i]], [1] * 3).shape[2] == 11
    with pytest.raises(FramesLost):
        assemble_chunk_lists(lambda i: [chunks[i]], [1] * 3, _stream_into(torch.empty(1, 9, 3, 3, 2)))


def test_device_output_buffer_only_where_comfyuis_own_holds_the_same_values(monkeypatch):
    """A chunked-output model (LTX's VideoVAE) gets its output buffer on the VAE's device in the
    decoder's dtype when ComfyUI's own buffer would be fp32, within the size limit, and only
    for a fused decode (a stock-module decode has no memory to spare for it)."""
    import types

    from fast_vae_decode.fastpath.gate import gate_for
    from fast_vae_decode.fastpath.pixels import decode as pixel_decode

    model = torch.nn.Module()
    model.comfy_has_chunked_io = True
    model.decode_output_shape = lambda s: (s[0], 3, 9, 32, 32)
    z = torch.zeros(1, 128, 2, 1, 1, dtype=torch.bfloat16)

    def vae(dtype):
        return types.SimpleNamespace(first_stage_model=model, vae_output_dtype=lambda: dtype)

    assert pixel_decode._device_output(vae(torch.float32), z) == {}  # no gate yet
    with gate_for(model).opened(False):
        assert pixel_decode._device_output(vae(torch.float32), z) == {}  # lossless
    with gate_for(model).opened(True):
        buf = pixel_decode._device_output(vae(torch.float32), z)["output_buffer"]
        assert buf.shape == (1, 3, 9, 32, 32) and buf.dtype == torch.bfloat16 and buf.device == z.device
        assert pixel_decode._device_output(vae(torch.float16), z) == {}  # stock rounds to fp16 there
        monkeypatch.setattr(pixel_decode, "DEVICE_OUTPUT_MAX_BYTES", 1000)
        assert pixel_decode._device_output(vae(torch.float32), z) == {}
        monkeypatch.undo()
        model.comfy_has_chunked_io = False
        assert pixel_decode._device_output(vae(torch.float32), z) == {}


# --- a watched output buffer (FrameStream as a BufferSink: LTX on ComfyUI 0.33) -------------


def _write_in_chunks(stream, final, buffer, sizes, announced=None):
    """What the decoder and its head conv do: announce a chunk, then write it."""
    pos = 0
    for n, said in zip(sizes, announced or sizes, strict=True):
        stream.next_write(said)
        buffer[:, :, pos:pos + n].copy_(final[:, :, pos:pos + n])
        pos += n


def test_frame_stream_takes_a_watched_buffer_as_the_decoder_writes_it(monkeypatch):
    monkeypatch.setattr(pixel_finish, "STAGE_BYTES", 3 * 8 * 12 * 4)
    final = _decoded((1, 3, 9, 8, 12))
    buffer = torch.zeros_like(final)  # frames taken before their write would finish zeros
    dest = torch.full((1, 9, 8, 12, 3), float("nan"))
    starts = []

    class Recording(pixel_finish.FrameStream):
        def take(self, chunk, start):
            starts.append(start)
            super().take(chunk, start)

    stream = Recording(_comfy_finish, lambda out: dest)
    assert stream.watch(buffer)
    _write_in_chunks(stream, final, buffer, [1, 4, 0, 4])
    assert starts == [0, 1]  # the first two chunks went while the last was still to come
    assert stream.complete(buffer) and starts == [0, 1, 5]
    assert torch.equal(dest, _reference(final))


def test_frame_stream_watching_a_buffer_loses_frames_when_writes_do_not_add_up():
    from fast_vae_decode.fastpath.pixels.frames import FramesLost

    final = _decoded((1, 3, 9, 4, 4))
    buffer = torch.zeros_like(final)
    stream = _stream_into(torch.empty(1, 9, 4, 4, 3))
    assert stream.watch(buffer)
    _write_in_chunks(stream, final, buffer, [1, 4, 4], announced=[1, 4, 3])
    with pytest.raises(FramesLost, match="8 frames announced"):
        stream.complete(buffer)
    assert not _stream_into(torch.empty(1, 9, 4, 4, 3)).complete(buffer)  # never watched


# --- the copy thread behind FrameStream on the GPU -------------------------------------------


class _FakeCopier:
    """Stands in for ``_Copier`` (which needs CUDA): records where and how each put ran."""

    def __init__(self, fail_at=None):
        self.calls, self.flushed, self.fail_at = [], False, fail_at

    def put(self, src, target, finish, after):
        import threading

        if len(self.calls) == self.fail_at:
            raise RuntimeError("simulated copy failure")
        target.copy_(finish(src))  # an in-place write, as the real copier's host copy
        self.calls.append((threading.current_thread().name, torch.is_inference_mode_enabled()))

    def flush(self):
        self.flushed = True


def test_copy_thread_copies_in_order_off_the_decoding_thread_in_its_mode():
    import threading

    with torch.inference_mode():  # ComfyUI decodes under it; its host pixels are inference tensors
        dest = torch.zeros(4, 3)
        thread = pixel_finish._CopyThread(_FakeCopier())
        for i in range(4):
            thread.put(torch.full((3,), float(i)), dest[i], lambda x: x + 1, None)
        thread.flush()
    assert torch.equal(dest, torch.arange(1.0, 5.0)[:, None].expand(4, 3))
    calls = thread.copier.calls
    assert len(calls) == 4 and all(inference for _, inference in calls)
    assert {name for name, _ in calls} == {"fast_vae_decode frame copier"} != {threading.current_thread().name}
    assert thread.copier.flushed and not thread.thread.is_alive()


def test_copy_thread_failure_says_frames_are_lost():
    from fast_vae_decode.fastpath.pixels.frames import FramesLost

    dest = torch.zeros(3, 2)
    thread = pixel_finish._CopyThread(_FakeCopier(fail_at=1))
    for i in range(3):
        thread.put(torch.ones(2), dest[i], lambda x: x, None)
    with pytest.raises(FramesLost, match="simulated copy failure"):
        thread.flush()
    assert len(thread.copier.calls) == 1  # nothing after the failure is copied
    assert not thread.thread.is_alive()


# Host copies the staging ring makes (``host_memcpy_``): a memmove where both sides are plain
# contiguous host tensors of one dtype and size; anything else is torch's own copy.
HOST_COPIES = [
    (torch.float32, (7, 5)),  # the ring's case: fp32 pixels
    (torch.bfloat16, (3, 2, 5)),  # 2-byte elements: the byte count is numel * element_size
    (torch.uint8, (0,)),  # empty: nothing to move, no pointer touched
    (torch.int64, (1,)),
]


@pytest.mark.parametrize("dtype,shape", HOST_COPIES)
def test_host_memcpy_copies_exactly(dtype, shape):
    src = (torch.arange(math.prod(shape)) % 97).to(dtype).reshape(shape)
    dest = torch.full(shape, 3).to(dtype)
    assert pixel_finish.host_memcpy_(dest, src) is dest
    assert torch.equal(dest, src)


# Split copies (``HostCopy.parts``): bytes a multiple of the part count or not, parts capped by
# MIN_PART_BYTES, and more parts asked than the copy can give.
SPLIT_COPIES = [
    (4, 4 << 20),  # four whole 1 MiB parts
    (3, (3 << 20) + 12),  # a ragged last part (element-aligned)
    (8, (2 << 20) + 4),  # capped at 2 parts of at least MIN_PART_BYTES
    (4, 1 << 16),  # under one part: a single memmove
]


@pytest.mark.parametrize("parts,nbytes", SPLIT_COPIES)
def test_host_memcpy_in_parts_copies_exactly(monkeypatch, parts, nbytes):
    """Every byte lands once: each part is its own memmove, on the pack's threads but one."""
    moves = []
    real = pixel_finish.ctypes.memmove

    def noted(d, s, n):
        moves.append(n)
        return real(d, s, n)

    monkeypatch.setattr(pixel_finish.ctypes, "memmove", noted)
    src = torch.arange(nbytes // 4, dtype=torch.int32)
    dest = torch.zeros_like(src)
    assert pixel_finish.host_memcpy_(dest, src, parts) is dest
    assert torch.equal(dest, src)
    assert sum(moves) == nbytes and all(n % 4 == 0 for n in moves)
    assert len(moves) == max(1, min(parts, nbytes // pixel_finish.MIN_PART_BYTES))


def test_host_memcpy_in_parts_copies_an_overlapping_view_whole():
    """Parts of an overlapping move could read bytes another part already wrote: one call."""
    buffer = torch.arange(3 << 19, dtype=torch.int32)  # 6 MiB
    expect = buffer[: 1 << 20].clone()
    pixel_finish.host_memcpy_(buffer[1 << 18: (1 << 18) + (1 << 20)], buffer[: 1 << 20], 4)
    assert torch.equal(buffer[1 << 18: (1 << 18) + (1 << 20)], expect)


@pytest.mark.parametrize("case", ["strided source", "other dtype", "conjugate view"])
def test_host_memcpy_leaves_anything_else_to_torch(case):
    """What a plain memmove would get wrong goes to ``copy_``: it strides, casts, resolves."""
    if case == "strided source":
        src, dest = torch.arange(12.0).reshape(3, 4).t(), torch.empty(4, 3)
    elif case == "other dtype":
        src, dest = torch.arange(6.0), torch.empty(6, dtype=torch.float64)
    else:
        src, dest = torch.tensor([1 + 2j, 3 - 1j]).conj(), torch.empty(2, dtype=torch.complex64)
    pixel_finish.host_memcpy_(dest, src)
    assert torch.equal(dest, src.to(dest.dtype).resolve_conj())


# HostCopy.memmove: forced either way, or (None) by the whole output's size.
@pytest.mark.parametrize("memmove,output_bytes,expected", [
    (None, 12 << 20, True),  # a 1024² image
    (None, 32 << 20, True),  # at the limit
    (None, 48 << 20, False),  # a 2048² image: torch's pool
    (None, 571 << 20, False),  # a video's output
    (True, 1 << 30, True),
    (False, 4, False),
])
def test_host_copy_chooses_memmove_by_output_size(memmove, output_bytes, expected):
    choice = pixel_finish.HostCopy(memmove=memmove, memmove_max_bytes=32 << 20)
    assert choice.uses_memmove(output_bytes) is expected


@pytest.mark.parametrize("memmove", [False, True])
def test_ring_copies_out_of_its_pinned_buffer_as_set(monkeypatch, memmove):
    """The ring's host-side step (``_drain``) goes through ``host_memcpy_`` exactly when its
    copier was made to, and fills its target with the buffer's first n elements."""
    calls = []
    real = pixel_finish.host_memcpy_

    def noted(dest, src, parts=1):
        calls.append((dest.numel(), src.numel()))
        return real(dest, src, parts)

    class Done:
        def synchronize(self):
            pass

    monkeypatch.setattr(pixel_finish, "host_memcpy_", noted)
    staging = pixel_finish._Staging.__new__(pixel_finish._Staging)
    staging.buffers = [torch.arange(10.0) + 100 * k for k in range(pixel_finish.RING)]
    copier = pixel_finish._Copier(staging, memmove=memmove)
    target = torch.zeros(2, 3)
    copier.pending[1] = (Done(), target, 6)
    copier.flush()
    assert calls == ([(6, 6)] if memmove else [])
    assert torch.equal(target.view(-1), staging.buffers[1][:6])
    assert copier.pending == [None] * pixel_finish.RING
