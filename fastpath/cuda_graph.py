"""A fused decoder's fast path replayed as one CUDA graph, where the host is the limit.

Two callers: a KL image decoder's whole fast path, and the first call of a video decoder's
chunk loop (Wan: its first latent frame, and with it the whole decode of a single-frame
latent), whose single frame gives the GPU less work per launch than the host needs to issue it.

Eagerly, an image decode is ~600 launches issued from Python, and at the small stages the GPU
finishes each kernel before the host has issued the next (SDXL 1024² on an H200: 17.5 ms of
GPU work, 21-29 ms end to end). Once a decoder has run eagerly on an input shape (folds built,
Triton kernels compiled), its next fast decode of that shape with the same weights is captured
into a CUDA graph, and every later one replays it: one launch, the GPU never waits on Python.

Invariants:
- A graph reads the addresses it was captured with. A replay's output is used only if every
  module's weights, fetched for that decode (ComfyUI's own cast, outside the graph), are the
  very tensors fetched before the capture (``data_ptr``), and no fold was built or dropped
  anywhere since (``cache.generation``); otherwise the decode runs eagerly and a later one
  captures again. A graph that reads nothing but the decoder's own copies may run before that
  fetch (``_replay_ahead``), and so may one reading ComfyUI's tensors in place while every one
  of them is still the same live object at the same address; any other graph runs only after
  the fetch.
- Nothing is built inside a capture (a capture records launches, it runs nothing, so a fold
  built there would hold garbage): a key is captured only after an eager decode with the same
  key, weights and fold generation, and a capture that changed the generation is not used.
- The whole decoder ran fused: a module on its stock path fetches its own weights inside the
  capture, so a capture with any fallback is not used.
- Memory: a decoder's graphs share one private pool that keeps the decode's activations
  between decodes; a graph is kept only while that pool is at most ``MAX_POOL_FRACTION`` of
  the device, and it goes with the folds when ComfyUI unloads the model (``_fvd_cache``).
- A pool is captured into only while a kept graph still uses it. Once its last graph is reset
  (stale weights, refused, dropped) torch's allocator keeps the pool's entry with no user until
  its memory is emptied, and a capture into that handle fails torch's own assertion (seen on
  ComfyUI 0.33, whose dynamic VRAM moves a VAE's weights whenever another model loads). Such a
  failure inside ``capture_begin`` also leaves the device's default random generator in capture
  mode on torch <= 2.11, after which every random op outside a capture raises "Offset
  increment outside graph capture" -- a sampler's noise included. So a decoder with no kept
  graph starts a fresh pool, and a failed capture mends the generator (``_mend_generator``).
- Weights ComfyUI places (a dynamic-VRAM slot, a weight it force-loads onto the device, the
  kept cast of one: ``placed_by_comfyui``) are read through copies the decoder keeps
  (``_PlacedCopy``), never where ComfyUI put them: dynamic VRAM (ComfyUI 0.33's default)
  prepares a VAE again whenever another model was loaded in between, which in a workflow is
  before every decode (the sampler runs between them), and puts all of them at new places.
  Each decode still fetches them (a slot is pinned for the call and given back after); where
  ComfyUI handed over new tensors, their bits are compared with the copy's on the GPU (one host
  read for all), and only a copy whose bits differ is made anew, which changes the fingerprint.
  So a graph, and every fold of those weights, outlives the move. SDXL 1024² on an H200
  (0.33): a decode right after another VAE decoded took 69.7 ms, eager with two folds rebuilt,
  against 23.1 replayed. The copies count against the pool's budget and go with the graphs.
- Outputs are handed out as copies (a later replay rewrites the graph's own), in the
  structure ``run`` returned: tensors in lists and tuples, anything else (a cache slot's
  marker string, None) as it was at capture.
- The input is copied into a static tensor with the caller's strides: kernels and cuDNN plans
  are chosen by strides too, and the capture must launch what the eager decode compiled.
- Never for lossless (its gate is closed), never under ComfyUI's ``--disable-cuda-graphs``.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import generation, kept, kept_values
from .comfyui.flags import cuda_graphs_disabled
from .comfyui.weights import (
    call_tensors,
    placed_by_comfyui,
    read_instead,
    weights_for_call,
)
from .log import log_once

# A decoder's graphs share one pool, so two shapes (a tiled decode's full and edge tiles, the
# last batch slice) cost about one decode's activations, not two.
MAX_GRAPHS = 2
# The pool is memory ComfyUI's estimates count as free; kept small against the device
# (an H200's 1/16 is 8.8 GB; a 24 GB card's 1.5 GB, about one SDXL 1024² decode).
MAX_POOL_FRACTION = 1 / 16
_ENTRY = "cuda_graphs"
# ``graph_status`` of a decode whose shape decodes eagerly for good (``_Graphs.refused``).
REFUSED = "refused for this shape"

Run = Callable[[torch.Tensor], object]


def _copied(out):
    """``out`` with every tensor in it cloned (their layouts kept), lists and tuples rebuilt."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_copied(item) for item in out)
    return out


@dataclass
class _Captured:
    graph: object
    static_in: torch.Tensor
    static_out: object  # what ``run`` returned: a tensor, or lists and tuples of them
    weights: tuple
    generation: int
    fused_calls: int  # fused calls inside the decoder one replay stands for
    # The weights it reads where ComfyUI keeps them, not through a copy the decoder keeps
    # (``_PlacedCopy``): ``_sources``, for the check before a replay ahead (``_still_held``).
    in_place: tuple = ()


@dataclass
class _Graphs:
    """One decoder's graphs and the eager decodes that may be captured next."""

    pool: object = None
    pool_bytes: int = 0
    captured: "OrderedDict[tuple, _Captured]" = field(default_factory=OrderedDict)
    seen: "OrderedDict[tuple, tuple]" = field(default_factory=OrderedDict)  # key -> (weights, gen)
    refused: set = field(default_factory=set)
    just_seen: tuple | None = None  # the key the last eager decode remembered (``settle``)
    copies: dict = field(default_factory=dict)  # id(module) -> _PlacedCopy
    # The tensors the current call's ``_weights`` found read in place, for a capture
    # (``_capture`` keeps their ``_sources``); emptied when the call ends, so no weight
    # ComfyUI drops is kept alive between decodes.
    in_place: tuple = ()
    # What the last fast decode did: "replayed", "captured", or why it ran eagerly.
    last: str = "no decode yet"
    lock: threading.Lock = field(default_factory=threading.Lock)

    # A copied model gets no graphs: they read the original's weights and folds.
    def __deepcopy__(self, memo) -> "_Graphs":
        return _Graphs()

    def __reduce__(self):
        return (_Graphs, ())

    def forget(self) -> None:
        for entry in self.captured.values():
            _reset(entry.graph)
        self.captured.clear()
        self.seen.clear()
        self.copies.clear()
        self.pool, self.pool_bytes = None, 0

    def copy_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies.values())


def _reset(graph) -> None:
    reset = getattr(graph, "reset", None)
    if reset is not None:
        # Tensors captured in the pool are freed after their graph: torch warns about it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reset()


class CudaGraphs:
    """The backend: torch's CUDA graphs. Tier-1 tests swap in a CPU stand-in."""

    def usable(self, x: torch.Tensor) -> bool:
        return x.is_cuda and not torch.cuda.is_current_stream_capturing()

    def new_pool(self, device: torch.device):
        return torch.cuda.graph_pool_handle()

    def capture(self, run: Run, static_in: torch.Tensor, pool) -> tuple[object, object, int]:
        """(graph, its output, bytes its pool grew by)."""
        device = static_in.device
        torch.cuda.synchronize(device)
        reserved = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        stream = _capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                # thread_local: ComfyUI's other threads may touch CUDA while this one captures.
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = run(static_in)
                finally:
                    graph.capture_end()
        except BaseException:
            _mend_generator(device)
            raise
        torch.cuda.current_stream(device).wait_stream(stream)
        return graph, out, max(0, torch.cuda.memory_reserved(device) - reserved)

    def pool_budget(self, device: torch.device) -> int:
        return int(torch.cuda.get_device_properties(device).total_memory * MAX_POOL_FRACTION)


def _mend_generator(device: torch.device) -> None:
    """After a failed capture: if the device's default generator was left in capture mode (a
    random op outside any capture raises), put a copy of its state in its place -- same seed
    and offset, not capturing. The probe's own draw is given back, so the random stream the
    process sees is the one it would have seen."""
    if torch.cuda.is_current_stream_capturing():
        return
    generator = torch.cuda.default_generators[device.index]  # a CUDA tensor's device has one
    offset = generator.get_offset()
    try:
        torch.empty(1, device=device).uniform_()
    except RuntimeError:
        generator.graphsafe_set_state(generator.clone_state())
        log_once("cuda_graph:generator", "a failed CUDA graph capture left torch's random "
                 "generator in capture mode; its state was restored")
    else:
        generator.set_offset(offset)


_STREAMS: dict = {}


def _capture_stream(device: torch.device):
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


BACKEND = CudaGraphs()


def graph_status(model: torch.nn.Module) -> list[str]:
    """What each graphed decoder under ``model`` did on its last fast decode."""
    return [graphs.last for graphs in kept_values(model, _ENTRY)]


def graph_bytes(model: torch.nn.Module) -> int:
    """Bytes the CUDA-graph pools under ``model``, and the weight copies their graphs read,
    hold between decodes."""
    return sum(graphs.pool_bytes + graphs.copy_bytes() for graphs in kept_values(model, _ENTRY))


def _weights(state: _Graphs, module: torch.nn.Module,
             x: torch.Tensor) -> tuple[tuple | None, str | None]:
    """Fetch every weight under ``module`` into the open scope, those ComfyUI placed replaced by
    their kept copies (``_use_copies``): (the addresses the decode reads, None), or (None, why)
    when a module's cannot be fetched as tensors that outlive the call (streamed, cast per
    call, patched)."""
    read, placed = [], []
    for m in _weighted_modules(module):
        reason, tensors, stable = call_tensors(m, x)
        if reason is None and not stable:
            reason = "weights copied per call"
        if reason is not None:
            name = next((n for n, sub in module.named_modules() if sub is m), "")
            return None, f"{name or type(m).__name__}: {reason}"
        if placed_by_comfyui(m):
            placed.append((m, tensors))
        read.append((m, tensors))
    if placed:
        _use_copies(state, placed)
        read = [(m, state.copies[id(m)].tensors if id(m) in state.copies else tensors)
                for m, tensors in read]
    state.in_place = tuple(t for m, tensors in read if id(m) not in state.copies
                           for t in tensors if t is not None)
    return tuple(None if t is None else t.data_ptr() for _, tensors in read for t in tensors), None


@dataclass
class _PlacedCopy:
    """A module's placed weights as a graphed decoder reads them: ``tensors`` (``_parameters``
    order) hold the bits ComfyUI's tensors ``sources`` (``_sources``) held."""

    module: torch.nn.Module
    sources: tuple
    tensors: tuple
    weight: torch.Tensor | None = None  # ``tensors`` by name, for the scope (``read_instead``)
    bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)

    def fits(self, module: torch.nn.Module, tensors: tuple) -> bool:
        return self.module is module and len(tensors) == len(self.tensors) and all(
            (a is None) == (b is None) and (a is None or (
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device))
            for a, b in zip(self.tensors, tensors, strict=True))


def _sources(tensors: tuple) -> tuple:
    """ComfyUI's tensors as objects and addresses. It places weights again as new tensor
    objects, at the same address or another, so only the same objects at the same addresses
    are known to hold the same bits; anything else is compared."""
    return tuple(None if t is None else (weakref.ref(t), t.data_ptr()) for t in tensors)


def _same_sources(sources: tuple, tensors: tuple) -> bool:
    return all((s is None) == (t is None) and (t is None or (s[0]() is t and s[1] == t.data_ptr()))
               for s, t in zip(sources, tensors, strict=True))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(pairs: list) -> list[bool]:
    """For each (copy, placed) pair of tensor tuples: whether any element's bits differ (NaNs
    and signed zeros compared as stored). One device-to-host read for all of them."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(_BITS[t.element_size()])

    flags = [torch.stack([(bits(a) != bits(b)).any()
                          for a, b in zip(copy, placed, strict=True) if a is not None]).any()
             for copy, placed in pairs]
    return torch.stack(flags).tolist() if flags else []


def _use_copies(state: _Graphs, placed: list) -> None:
    """Point the open scopes' placed weights at the copies the decoder keeps: a module whose
    tensors are still its copy's sources is read through the copy as it is; one ComfyUI placed
    anew keeps its copy where the bits are the same, and gets a new copy (new addresses: graphs
    and folds of the old one are stale) where they differ or a shape changed."""
    moved, fresh = [], []
    for m, tensors in placed:
        kept_copy = state.copies.get(id(m))
        if kept_copy is None or not kept_copy.fits(m, tensors):
            fresh.append((m, tensors))
        elif not _same_sources(kept_copy.sources, tensors):
            moved.append((m, tensors, kept_copy))
    for (m, tensors, kept_copy), differ in zip(
            moved, _bits_differ([(c.tensors, t) for _, t, c in moved]), strict=True):
        if differ:
            fresh.append((m, tensors))
        else:
            kept_copy.sources = _sources(tensors)
    for m, tensors in fresh:
        copied = tuple(None if t is None else t.clone() for t in tensors)
        named = dict(zip(m._parameters, copied, strict=True))
        state.copies[id(m)] = _PlacedCopy(m, _sources(tensors), copied, named.get("weight"),
                                          named.get("bias"))
    for m, _ in placed:
        kept_copy = state.copies[id(m)]
        read_instead(m, kept_copy.weight, kept_copy.bias)


def _weighted_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under ``root`` (itself included, each once) that has Parameters, walked
    afresh per call: a module ComfyUI swapped in since the capture must change the fingerprint.
    ``named_modules`` without the names (its recursive generator and the name strings were a
    third of a replay's host time before the graph launched)."""
    found, seen, todo = [], set(), [root]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m._parameters:
            found.append(m)
        todo.extend(c for c in reversed(m._modules.values()) if c is not None)
    return found


def settings_key(settings) -> tuple:
    """A family's settings dataclass as part of a graph's key: its field values in order (the
    instance's own attributes; ``dataclasses.astuple`` deep-copies them, 10 us per replay)."""
    return tuple(vars(settings).values())


def graphed_call(module: torch.nn.Module, x: torch.Tensor, run: Run, key: tuple,
                 gate=None):
    """``run(x)`` (a fused decoder's whole fast path, or a video decoder's first chunk: every
    weight ``run`` reads is under ``module``), replayed from a CUDA graph where it can be.

    ``key`` holds whatever besides ``x``'s shape, strides, dtype and device decides which
    kernels ``run`` launches (the family's settings). ``gate``: the model's, where ``module``
    is not itself fused.
    """
    gate = module._fvd_gate if gate is None else gate
    if (not BACKEND.usable(x) or gate is None or not gate.is_open
            or torch.compiler.is_compiling()):
        return run(x)
    state = kept(module, _ENTRY, _Graphs)
    why = ("ComfyUI --disable-cuda-graphs" if cuda_graphs_disabled() else
           "the warm-up has not run" if gate.prewarm_modules is not None else None)
    if why is not None or not state.lock.acquire(blocking=False):
        state.last = why or "another thread is replaying this decoder"
        return run(x)
    try:
        return _call(state, module, gate, x, run,
                     (tuple(x.shape), x.stride(), x.dtype, x.device) + key)
    finally:
        state.in_place = ()
        state.lock.release()


def _call(state: _Graphs, module, gate, x, run: Run, key: tuple):
    state.just_seen = None
    if key in state.refused and not state.captured:
        # A shape refused a graph, with none kept, decodes eagerly for good: no copies and no
        # fingerprint. Each block then fetches its own weights as it runs, so the first kernels
        # launch at once; fetching all of them first kept the GPU waiting for the host (SDXL
        # 2048² on an H100, whose pool budget refuses that shape: 1.8 ms before conv_in, 2.7
        # ms idle in the decode's first tenth, docs/benchmark/s39).
        state.copies.clear()
        state.last = REFUSED
        return run(x)
    with weights_for_call():
        ahead = _replay_ahead(state, x, key)
        weights, why = _weights(state, module, x)
        if ahead is not None:
            hit, out, _held = ahead  # ``_held``: alive until the check has decided
            if weights is not None and weights == hit.weights and hit.generation == generation():
                return _replayed(state, gate, key, hit, out)
            del out  # stale (other weights, or copies of other bits): decoded below as without it
        if weights is not None:
            out = _replay_or_capture(state, module, gate, x, run, key, weights)
            if out is not None:
                return out
            stats = gate.stats
            calls, fallbacks, errors = stats.fused_calls, sum(stats.fallbacks.values()), \
                len(stats.kernel_errors)
            out = run(x)
            if (sum(stats.fallbacks.values()) == fallbacks and len(stats.kernel_errors) == errors
                    and stats.fused_calls > calls):
                _remember(state.seen, key, (weights, generation()))
                state.just_seen = key
            else:
                state.last = "a module left the fast path"
            return out
    # Some weights are not kept in place (streamed, cast per call): the blocks fetch their own.
    state.forget()
    state.last = why
    return run(x)


def settle(module: torch.nn.Module) -> None:
    """Count the eager call ``module`` just made as seen with the folds as they are now.

    For a call followed by others in the same decode (a video loop's first call, then its
    steady-state chunks, which build folds of their own the first call never reads): otherwise
    every decode would find the folds changed since its first call and none would capture.
    Safe because a capture checks for itself that nothing was built during it. Only for a
    decode that finished; a captured graph is never settled (a fold it reads may have gone).
    """
    for state in kept_values(module, _ENTRY):
        key, state.just_seen = state.just_seen, None
        if key in state.seen:
            state.seen[key] = (state.seen[key][0], generation())


def _remember(table: OrderedDict, key: tuple, value) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_GRAPHS:
        dropped = table.popitem(last=False)[1]
        if isinstance(dropped, _Captured):
            _reset(dropped.graph)


@dataclass
class ReplaySettings:
    # Replay a graph that reads only the decoder's copies before its weights are fetched and
    # checked, and keep the output once the check confirms them (``_replay_ahead``).
    ahead: bool = True


replay_settings = ReplaySettings()


def _replay_ahead(state: _Graphs, x: torch.Tensor, key: tuple):
    """``(graph, its output, the tensors it read in place)``, replayed before ``_weights``
    fetches and checks the weights, or None; the caller keeps the output only if the check
    finds the very weights the graph was captured with (else it drops it and decodes as if this
    had not run).

    Before a replay the host fetches every weight through ComfyUI (39 VRAM slots for the SDXL
    decoder under 0.33's dynamic VRAM) and checks it against the decoder's copies, while the
    GPU waits: 5.7-6.4 ms of a 26 ms SDXL 1024² decode on an H100 (0.33; 19 ms of it the
    graph, docs/benchmark/34207ac). Run ahead, that work overlaps the graph.
    A replay that turns out stale must still read only allocated memory, never memory ComfyUI
    freed. A graph of copies has that by construction: its copies, folds and pool are the
    decoder's own and outlive any change ComfyUI makes. A graph that reads ComfyUI's tensors in
    place (0.8, or legacy loading: Parameters on the device) replays ahead only while each of
    them is still the same live object at the same address (``_still_held``; -0.6 ms per
    replayed 1024² decode on 0.8, H100, docs/benchmark/s32), and those objects are held until
    the check has decided. Memory a replay reads is freed, if at all, on the stream the replay
    runs on (a replaced copy, a weight ComfyUI drops), so no later work reuses it before the
    replay ends.
    """
    hit = state.captured.get(key)
    if (not replay_settings.ahead or hit is None or hit.generation != generation()):
        return None
    held = _still_held(hit.in_place)
    if held is None:
        return None
    return hit, _replay(hit, x), held


def _still_held(sources: tuple) -> tuple | None:
    """The tensors ``sources`` (``_sources``) names, where every one is alive and still at its
    address; else None. A live tensor keeps its storage, so that memory is allocated; and a
    host and a device allocation never share an address (unified virtual addressing), so the
    same address is the same device memory."""
    held = []
    for ref, ptr in sources:
        t = ref()
        if t is None or t.data_ptr() != ptr:
            return None
        held.append(t)
    return tuple(held)


def _replay(hit: _Captured, x: torch.Tensor):
    """The graph run on ``x``; its output as the caller's own copy."""
    hit.static_in.copy_(x)
    hit.graph.replay()
    return _copied(hit.static_out)


def _replayed(state: _Graphs, gate, key: tuple, hit: _Captured, out):
    gate.stats.fused_calls += hit.fused_calls
    state.captured.move_to_end(key)
    state.last = "replayed"
    return out


def _replay_or_capture(state: _Graphs, module, gate, x, run: Run, key, weights):
    hit = state.captured.get(key)
    if hit is not None:
        if hit.weights == weights and hit.generation == generation():
            return _replayed(state, gate, key, hit, _replay(hit, x))
        _reset(state.captured.pop(key).graph)  # stale: the eager decode below may rebuild folds
        if not state.captured:
            state.pool, state.pool_bytes = None, 0  # no user left: the pool is dead (note)
    seen = state.seen.get(key)
    if key in state.refused or seen != (weights, generation()):
        state.last = (REFUSED if key in state.refused else
                      "first decode of this shape" if seen is None else
                      "weights moved since the last decode" if seen[0] != weights else
                      "folds built or dropped since the last decode")
        return None
    return _capture(state, module, gate, x, run, key, weights)


def _capture(state: _Graphs, module, gate, x, run: Run, key, weights):
    stats = gate.stats
    before = (stats.fused_calls, dict(stats.fallbacks), list(stats.kernel_errors))
    gen = generation()
    if not state.captured:
        # No kept graph uses the old pool (or there is none): torch would refuse a capture
        # into a pool whose graphs all went (module note).
        state.pool, state.pool_bytes = BACKEND.new_pool(x.device), 0
    static_in = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
    static_in.copy_(x)
    try:
        graph, static_out, grown = BACKEND.capture(run, static_in, state.pool)
    except torch.OutOfMemoryError:
        _restore(stats, before)
        state.refused.add(key)
        raise  # as an eager decode would: ComfyUI retries tiled
    except Exception as exc:  # fail closed: this key decodes eagerly from now on
        _restore(stats, before)
        state.refused.add(key)
        state.last = f"capture failed: {type(exc).__name__}"
        log_once(f"cuda_graph:{type(module).__name__}:{type(exc).__name__}",
                 f"{type(module).__name__}: CUDA graph capture failed "
                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
                 "decoding eagerly")
        return None
    state.pool_bytes += grown
    why = None
    if stats.kernel_errors != before[2] or stats.fallbacks != before[1]:
        why = "a module left the fast path"
    elif generation() != gen:
        why = "a fold was built during the capture"
    elif state.pool_bytes + state.copy_bytes() > BACKEND.pool_budget(x.device):
        why = (f"its memory pool and weight copies "
               f"({(state.pool_bytes + state.copy_bytes()) / 2**20:.0f} MiB) are over "
               f"{MAX_POOL_FRACTION:.4g} of the device")
    if why is not None:
        _reset(graph)
        if stats.kernel_errors != before[2]:
            return None  # the errors stay in this decode's stats: the caller re-runs it stock
        _restore(stats, before)
        state.refused.add(key)
        state.last = f"capture not kept: {why}"
        if not state.captured:
            state.forget()
        log_once(f"cuda_graph:{type(module).__name__}:{why}",
                 f"{type(module).__name__}: no CUDA graph for {tuple(x.shape)} ({why}); "
                 "decoding eagerly")
        return None
    graph.replay()
    _remember(state.captured, key, _Captured(graph, static_in, static_out, weights, gen,
                                             stats.fused_calls - before[0],
                                             _sources(state.in_place)))
    state.seen.pop(key, None)
    state.last = "captured"
    return _copied(static_out)


def _restore(stats, before) -> None:
    stats.fused_calls, stats.fallbacks, stats.kernel_errors = (
        before[0], dict(before[1]), list(before[2]))
