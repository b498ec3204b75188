"""Decoded pixels to host memory: finished on the decoder's device, copied once through pinned
staging, and for video while the decoder is still running.

ComfyUI's ``VAE.decode`` copies the raw decoder output to the CPU (pageable) and there casts it
to fp32, rescales and clamps it, each pass into fresh memory; ``VAEDecode`` then copies it once
more into frames. On an H200 host that tail took 128 ms for 33 frames of 480x832 and 304 ms for
81, against 287 ms for the whole fused 33-frame decode on the GPU. The same elementwise fp32
steps give the same bits on either device (IEEE add, divide, clamp; bf16/fp16 -> fp32 is exact),
so here they run on the GPU slice by slice and the finished pixels, already in
(B, *spatial, C) order, cross to host memory once: 15 ms for those 33 frames, 37 ms for 81.
``FrameStream`` goes further for video decodes: each chunk of frames crosses on a side stream,
driven by a worker thread, while the GPU decodes the next chunk, and (Wan) the whole output is
never held on the GPU.

Pageable host memory is the destination (the IMAGE a workflow keeps is ordinary memory); the
copy goes through a ring of small pinned buffers, so the GPU->host transfer of one slice overlaps
the host-side copy of another. A plain ``.to("cpu")`` into pageable memory measured 7x slower,
and pinned outputs would keep the largest video ever decoded page-locked in PyTorch's host cache
for the life of the process.

The host-side copy out of a pinned buffer is a ``memmove`` (``host_memcpy_``) split over the
pack's own threads, for outputs up to ``HostCopy.memmove_max_bytes`` (1024² images), instead of
torch's ``copy_``: torch splits a large host copy over its OpenMP pool, whose threads then
spin-wait for more work. On the 2-CPU CI host one 12 MiB ``copy_`` every 20 ms kept the other
thread spinning 7 ms per copy, against none after ``memmove``. On the 16-CPU H200 host 15
threads (a pool's worth beside the decoding thread) each burned 25-49% of a CPU while SDXL
``high`` decoded in a loop, and none while it idled; in the processes where they burned most,
plain torch calls on the decoding thread took up to 1.6x their host time, and the GPU waited
for the host (two decodes of 25.0 and 22.5 ms ran the same kernels, 18.7 ms summed). One
``memmove`` on one thread was steady but slower than the pool (SDXL +4%); in 4 parts on
threads that sleep between copies it was faster on 12 MiB outputs and 0.5-1.4% slower on 48 MiB
(``HostCopy``'s numbers). Larger outputs stay with ``copy_``: the pool copies them faster, and
a video keeps it busy from slice to slice (a whole LTX-2 output, 571 MiB, ran 17-43% slower in
4 parts).
"""
from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .frames import FramesLost

# Per staging buffer: big enough that per-slice overhead is noise (a 480x832 RGB fp32 frame is
# 4.6 MiB), small enough to pin freely. RING buffers per device, allocated on first use and kept
# (64 MiB pinned): a streamed Wan chunk (4 frames) is at most RING slices up to 1280x720, so a
# buffer is only ever waited for once the GPU has a later chunk queued.
STAGE_BYTES = 16 << 20
RING = 4

Finish = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class HostCopy:
    """How the ring copies a slice out of its pinned buffer (see the module's note); the
    benchmark flips it (``bench --host-copies``) to measure the choice."""

    # True: ``host_memcpy_``; False: torch's copy_; None: by the output's size, below.
    memmove: bool | None = None
    # With memmove: one copy in this many contiguous parts at once, the copying thread taking
    # one and the pack's own threads the rest. Those threads block on a queue between copies
    # (they sleep; OpenMP's spin), and the page faults of a fresh destination spread with them.
    parts: int = 4
    # memmove=None: outputs up to this size (1024² images, SD1.5 batch 4) go by memmove, larger
    # ones (2048² images, video) by copy_, whose pool copies a large output faster than the
    # parts do (and is busy from slice to slice). Measured on the H200 host, one process each,
    # decodes interleaved (as the ``interleave`` command does), 4 parts against copy_, ``high``:
    #   SDXL / Flux 1024² (12 MiB): -8.0 / -8.5% on 0.8; -10.7 / -4.1% on 0.33 with glibc's
    #     own malloc, +0.8 / +2.0% with the bench's steady malloc; Qwen-Image 1024² one frame
    #     -11.8% (0.33), +0.3% (0.8);
    #   SDXL 2048² (48 MiB): +1.4% (0.33), +0.5% (0.8); 8 parts +1.9 / +1.1%;
    #   LTX-2 768x512x121 (571 MiB): +43% (0.33), +17.5% (0.8); Wan 2.1 x33 (158 MiB) -0.4%.
    memmove_max_bytes: int = 32 << 20

    def uses_memmove(self, output_bytes: int) -> bool:
        return self.memmove if self.memmove is not None else output_bytes <= self.memmove_max_bytes


host_copy = HostCopy()

_STAGING: dict[int, "_Staging"] = {}
_LOCK = threading.Lock()


class _Staging:
    def __init__(self, elements: int):
        # Normal tensors even when first made under inference mode: an inference tensor could
        # not be written by a later decode that runs outside it.
        with torch.inference_mode(False):
            self.buffers = [torch.empty(elements, dtype=torch.float32, pin_memory=True)
                            for _ in range(RING)]
        self.lock = threading.Lock()
        self.stream: "torch.cuda.Stream | None" = None

    def copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The side stream ``FrameStream`` copies on, made once per ring (the holder of
        ``lock`` asks). The caching allocator keeps freed blocks per stream, and torch hands
        out its 32 pooled streams in turn: a new stream per decode left every decode's
        finished slices in new segments (Wan 2.1 x33: 3 cudaMallocs and ~50 MiB more reserved
        per decode, H100, ComfyUI 0.8), until each pooled stream had its own."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream


def _staging(device: torch.device, elements: int) -> _Staging | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        staging = _STAGING.get(index)
        if staging is None or staging.buffers[0].numel() != elements or len(staging.buffers) != RING:
            try:
                staging = _Staging(elements)
            except RuntimeError:  # pinning refused (container limits, driver): copy directly
                return None
            _STAGING[index] = staging
        return staging


def _slices(src: torch.Tensor, dest: torch.Tensor, limit: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(src [C, *s], dest [*s, C]) pairs covering one item, each at most ``limit`` fp32 bytes.

    Splits along the first spatial axis, taking as many whole slices as fit; a slice that alone
    is too big (a 4K video frame) is split along its own first axis. Every ``dest`` piece is a
    contiguous block of the contiguous ``dest``.
    """
    if src.numel() * 4 <= limit or src.ndim < 2:
        yield src, dest
        return
    per_slice = src[:, 0].numel() * 4
    if per_slice > limit and src.ndim > 2:
        for i in range(src.shape[1]):
            yield from _slices(src[:, i], dest[i], limit)
        return
    step = max(1, limit // per_slice)
    for start in range(0, src.shape[1], step):
        yield src[:, start:start + step], dest[start:start + step]


def _pieces(out: torch.Tensor, dest: torch.Tensor):
    return ((s, d) for b in range(out.shape[0]) for s, d in _slices(out[b], dest[b], STAGE_BYTES))


# A part smaller than this is not worth a thread hand-off (about 20 us).
MIN_PART_BYTES = 1 << 20

_COPY_POOL: dict[int, ThreadPoolExecutor] = {}  # by worker count: one, unless a bench flips it


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _COPY_POOL.get(workers)
        if pool is None:
            pool = _COPY_POOL[workers] = ThreadPoolExecutor(workers, "fast_vae_decode host copy")
        return pool


def host_memcpy_(dest: torch.Tensor, src: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """``dest.copy_(src)`` for two host tensors without torch's OpenMP pool (see the module's
    note): a ``memmove`` where both are contiguous with one dtype and size, in up to ``parts``
    pieces at once (``HostCopy.parts``), ``copy_`` else. ctypes releases the GIL for each call,
    as ``copy_`` does."""
    if (dest.device.type == src.device.type == "cpu" and dest.dtype == src.dtype
            and dest.shape == src.shape and dest.is_contiguous() and src.is_contiguous()
            and not dest.is_conj() and not src.is_conj() and not dest.is_neg() and not src.is_neg()):
        nbytes = dest.numel() * dest.element_size()
        parts = max(1, min(parts, nbytes // MIN_PART_BYTES))
        # Pieces end on element boundaries; memmove is safe for overlap only as one call, so
        # overlapping tensors (a view copied onto itself) are copied whole.
        d, s = dest.data_ptr(), src.data_ptr()
        if parts == 1 or abs(d - s) < nbytes:
            if nbytes:
                ctypes.memmove(d, s, nbytes)
            return dest
        step = -(-dest.numel() // parts) * dest.element_size()
        spans = [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)]
        others = [_copy_pool(parts - 1).submit(ctypes.memmove, d + o, s + o, n)
                  for o, n in spans[1:]]
        ctypes.memmove(d, s, spans[0][1])
        for done in others:
            done.result()
        return dest
    return dest.copy_(src)


def _check_dest(dest: torch.Tensor) -> None:
    if not dest.is_contiguous() or dest.dtype != torch.float32:
        raise ValueError("dest must be a contiguous float32 tensor")


def _finished(src: torch.Tensor, finish: Finish) -> torch.Tensor:
    """One slice (C, *s) finished in fp32 and moved to (*s, C)."""
    return finish(src.float()).movedim(0, -1)


def _finish_directly(pieces, finish: Finish) -> None:
    for src, target in pieces:
        target.copy_(_finished(src, finish))


def _ring_for(out: torch.Tensor, dest: torch.Tensor) -> "_Staging | None":
    """The staging ring for a GPU -> host copy; None where copies go directly."""
    return _staging(out.device, STAGE_BYTES // 4) if out.is_cuda and not dest.is_cuda else None


class _Copier:
    """Finished slices from the GPU into host ``target``s through the staging ring.

    ``put`` enqueues a slice's finish and its GPU->buffer copy (on ``stream``, after ``after``)
    and returns; the buffer is copied out to its target only when the ring comes round to it
    again, or at ``flush``. So the host waits for the GPU only for slices enqueued ``RING``
    slices ago.
    """

    def __init__(self, staging: _Staging, stream: torch.cuda.Stream | None = None,
                 memmove: bool = False):
        self.staging = staging
        self.stream = stream
        self.memmove = memmove  # host_memcpy_ (``HostCopy.uses_memmove`` of the whole output)
        self.pending: list[tuple[torch.cuda.Event, torch.Tensor, int] | None] = [None] * RING
        self.next = 0

    def put(self, src: torch.Tensor, target: torch.Tensor, finish: Finish,
            after: torch.cuda.Event | None = None) -> None:
        slot = self.next
        self._drain(slot)
        stream = self.stream if self.stream is not None else torch.cuda.current_stream(src.device)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            done = _finished(src, finish).contiguous().view(-1)
            buffer = self.staging.buffers[slot]
            if done.numel() > buffer.numel():  # a lone pixel row over the limit
                target.view(-1).copy_(done)
                return
            buffer[:done.numel()].copy_(done, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        self.pending[slot] = (copied, target, done.numel())
        self.next = (slot + 1) % RING

    def _drain(self, slot: int) -> None:
        entry = self.pending[slot]
        if entry is None:
            return
        self.pending[slot] = None
        copied, target, n = entry
        copied.synchronize()
        source = self.staging.buffers[slot][:n]
        if self.memmove:
            host_memcpy_(target.view(-1), source, host_copy.parts)
        else:
            target.view(-1).copy_(source)

    def flush(self) -> None:
        for k in range(RING):
            self._drain((self.next + k) % RING)


class _CopyThread:
    """A copier (``_Copier``) driven by a worker thread: ``put`` only queues, so the decoding
    thread never waits for the GPU or copies host memory while it could be launching the next
    chunk's kernels (waiting there drained the GPU's queue once per chunk, and the host copy of
    a fresh destination, page faults included, ran while the GPU idled).

    The worker keeps each queued slice referenced until its kernels are queued on the copier's
    stream, so the slice's memory (``record_stream``-ed to that stream by the caller) is freed
    only after them. It runs in the grad and inference mode of the thread that made it (the
    host pixels are inference tensors under ComfyUI's ``inference_mode``). A failure there
    is raised by ``flush`` as ``FramesLost``: frames may be missing from the destination.
    """

    def __init__(self, copier, device: torch.device | None = None):
        self.copier = copier
        self.device = device
        self.modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fast_vae_decode frame copier",
                                       daemon=True)
        self.thread.start()

    def put(self, *item) -> None:
        self.queue.put(item)

    def _run(self) -> None:
        grad, inference = self.modes
        device = torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext()
        with device, torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while (item := self.queue.get()) is not None:
                if self.error is None:
                    try:
                        self.copier.put(*item)
                    except BaseException as exc:  # noqa: BLE001 - handed to the decoding thread
                        self.error = exc
                del item
            if self.error is None:
                try:
                    self.copier.flush()
                except BaseException as exc:  # noqa: BLE001
                    self.error = exc

    def flush(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise FramesLost(f"copying frames to host memory failed: {self.error!r}") from self.error


def finish_pixels(out: torch.Tensor, finish: Finish, dest: torch.Tensor) -> None:
    """``dest[:] = finish(out.float()).movedim(1, -1)``, computed on ``out``'s device.

    ``out`` is a decoder output (B, C, *spatial) on any device; ``dest`` a contiguous fp32
    (B, *spatial, C) tensor in host memory. ``finish`` must be elementwise (it sees slices).
    """
    _check_dest(dest)
    staging = _ring_for(out, dest)
    if staging is None:
        _finish_directly(_pieces(out, dest), finish)
        return
    with staging.lock, torch.cuda.device(out.device):
        copier = _Copier(staging, memmove=host_copy.uses_memmove(dest.numel() * 4))
        try:
            for src, target in _pieces(out, dest):
                copier.put(src, target, finish)
        finally:
            copier.flush()


class FrameStream:
    """Finishes a video decode's frames as its loop hands them over (a ``frames.FrameSink``), or
    as its decoder writes them into an output buffer (a ``frames.BufferSink``).

    ``begin`` allocates the host pixels (``dest_for`` of a stand-in shaped like the output) and
    takes every frame; each ``take``n chunk is finished on a side stream once the GPU has
    produced it, while the GPU decodes the next (the chunk's memory stays claimed by that
    stream until its copies are done), and the loop keeps no whole output on the device.
    ``watch(buffer)`` begins for a decoder's output buffer instead: each ``next_write`` takes
    the frames written before it. Without a free staging ring (a CPU decode, another decode
    holding it) chunks are finished where they stand. After the decode ``complete(result)``
    says whether ``dest`` holds every frame of ``result``; if not, the caller finishes
    ``result`` itself. ``close()`` must run in every case: it waits for copies in flight.
    """

    def __init__(self, finish: Finish, dest_for: Callable[[torch.Tensor], torch.Tensor]):
        self.finish = finish
        self.dest_for = dest_for
        self.source: torch.Tensor | None = None  # the output's stand-in (meta device)
        self.dest: torch.Tensor | None = None
        self.covered = 0
        self._copier: _CopyThread | None = None
        self._release: Callable[[], None] | None = None
        self.buffer: torch.Tensor | None = None  # the watched output buffer
        self.queued = 0  # frames of ``buffer`` written once the queued work is done

    def begin(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        if self.source is not None or len(shape) != 5:
            return False  # one output per stream, and only (B, C, T, H, W) frames
        source = torch.empty(shape, dtype=dtype, device="meta")
        dest = self.dest_for(source)
        _check_dest(dest)
        if tuple(dest.shape) != (shape[0], *shape[2:], shape[1]):
            return False
        self.source, self.dest = source, dest
        self._open(torch.device(device))
        return True

    def take(self, chunk: torch.Tensor, start: int) -> None:
        stop = start + chunk.shape[2]
        source = self.source
        if (source is None or start != self.covered or stop > source.shape[2]
                or chunk.shape[:2] != source.shape[:2] or chunk.shape[3:] != source.shape[3:]):
            raise FramesLost(f"frames {start}:{stop} of {tuple(chunk.shape)} do not follow the "
                             f"{self.covered} taken of {None if source is None else tuple(source.shape)}")
        self.covered = stop
        pieces = _pieces(chunk, self.dest[:, start:stop])
        if self._copier is None or not chunk.is_cuda:
            _finish_directly(pieces, self.finish)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(chunk.device))
        chunk.record_stream(self._copier.copier.stream)  # read there after the loop drops it
        for src, target in pieces:
            self._copier.put(src, target, self.finish, ready)

    def result(self) -> torch.Tensor:
        return self.source

    def watch(self, buffer: torch.Tensor) -> bool:
        """Take the frames of ``buffer`` (B, C, T, H, W), which the decoder fills in order, as
        ``next_write`` says they are written; False (nothing watched) where ``begin`` declines."""
        if not self.begin(tuple(buffer.shape), buffer.dtype, buffer.device):
            return False
        self.buffer = buffer
        return True

    def next_write(self, frames: int) -> None:
        if self.buffer is None:
            return
        if self.queued > self.covered:
            self.take(self.buffer[:, :, self.covered:self.queued], self.covered)
        self.queued += frames

    def _open(self, device: torch.device) -> None:
        if device.type != "cuda" or self.dest.is_cuda:
            return
        staging = _staging(device, STAGE_BYTES // 4)
        # Not waiting for the ring: another decode (another thread) holding it means this one
        # finishes its chunks where they stand.
        if staging is None or not staging.lock.acquire(blocking=False):
            return
        self._release = staging.lock.release
        copier = _Copier(staging, staging.copy_stream(device),
                         memmove=host_copy.uses_memmove(self.dest.numel() * 4))
        self._copier = _CopyThread(copier, device)

    def complete(self, result: torch.Tensor) -> bool:
        try:
            if self.buffer is not None and result is self.buffer:
                # Every write is queued now. Frames taken early were final only if the writes
                # announced add up to the buffer (otherwise the decoder wrote some other way).
                if self.queued != result.shape[2]:
                    raise FramesLost(f"{self.queued} frames announced for an output of "
                                     f"{result.shape[2]}")
                self.next_write(0)
                return self.covered == result.shape[2]
        finally:
            self.close()
        return (self.source is not None and result is self.source
                and self.covered == result.shape[2])

    def close(self) -> None:
        if self._copier is not None:
            try:
                self._copier.flush()
            finally:
                self._copier = None
                self._release()
