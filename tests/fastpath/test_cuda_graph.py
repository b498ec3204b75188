"""When a fused KL decoder, and a Wan decode loop's first call, capture, replay and give up
their CUDA graphs (``fastpath.cuda_graph``).

Tier 1 (CPU): the backend is swapped for a stand-in whose "capture" runs the decode once and
whose "replay" runs it again into the static output (a CPU has no graphs), so what is checked
here is the bookkeeping: which decode captures, which replays, which runs eagerly, and that
every replay reads the weights and folds it was captured with. Tier 3
(``test_kl_family_gpu.py``) checks real graphs against the eager fast path on a GPU.
"""
from __future__ import annotations

import copy
import sys
import types
import weakref

import pytest
import torch

from fast_vae_decode.fastpath import cache, cuda_graph, install
from fast_vae_decode.fastpath.comfyui import weights as comfy_weights
from fast_vae_decode.fastpath.families.kl import settings as kl_settings
from fast_vae_decode.fastpath.gate import gate_for

pytest.importorskip("diffusers")
from support.kl_models import _decode, _latent, tiny_vae  # noqa: E402


def _copy_into(dest, src) -> None:
    """What a replay does to a graph's outputs: the same tensors, rewritten."""
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, (list, tuple)):
        assert type(dest) is type(src) and len(dest) == len(src)
        for d, s in zip(dest, src, strict=True):
            _copy_into(d, s)
    else:
        assert dest == src  # a marker (None, a string) is what the capture left


class _Pool:
    """A graph pool handle as torch's caching allocator treats it: live while a graph captured
    into it is kept; once every such graph is reset the handle is dead, and a capture into it
    fails the allocator's assertion (``use_count > 0``) instead of starting a new pool."""

    def __init__(self):
        self.users = 0
        self.used = False


def _weak(t):
    return None if t is None else weakref.ref(t)


def _strong(ref):
    """The tensor ``ref`` names; None for no tensor, False for one that was freed."""
    if ref is None:
        return None
    t = ref()
    return False if t is None else t


class _Replayer:
    def __init__(self, backend, run, static_in, static_out, pool):
        self.backend, self.run, self.static_in, self.static_out = backend, run, static_in, static_out
        self.pool = pool
        self.was_reset = False
        # A graph reads the tensors the capture read, whatever the decode's scope holds when it
        # replays (a replay ahead of the weight check runs before they are fetched again). It
        # holds no reference to them, as a real graph holds none: a replay after one of them was
        # freed is a read of freed memory, which fails here.
        self.read = {k: (weakref.ref(m), _weak(f.weight), _weak(f.bias), f.stable)
                     for scope in comfy_weights._stack() for k, (m, f) in scope._held.items()}

    def replay(self):
        assert not self.was_reset
        self.backend.replays += 1
        self.backend.events.append("replay")
        # The real replay adds nothing to the decode's stats (graphed_call adds the capture's
        # count): run the stand-in under a gate state of its own.
        read = {k: (m(), _strong(w), _strong(b), stable) for k, (m, w, b, stable) in self.read.items()}
        assert all(m is not None and w is not False and b is not False
                   for m, w, b, _ in read.values()), "a replay read freed memory"
        with gate_for(self.backend.model).opened(True), comfy_weights.weights_for_call() as scope:
            scope._held.update({k: (m, comfy_weights._Fetched(w, b, stable, None))
                                for k, (m, w, b, stable) in read.items()})
            _copy_into(self.static_out, self.run(self.static_in))

    def reset(self):
        if not self.was_reset:
            self.pool.users -= 1
        self.was_reset = True


class CpuStandIn:
    """What ``cuda_graph.CudaGraphs`` does, on the CPU."""

    def __init__(self, model, pool_bytes=1 << 20, budget=1 << 30, fail=None):
        self.model, self.pool_bytes, self.budget, self.fail = model, pool_bytes, budget, fail
        self.captures = self.replays = 0
        self.graphs: list[_Replayer] = []
        self.events: list[str] = []  # "replay", and the simulated slots' "fetch" (in order)

    def usable(self, x):
        return True

    def new_pool(self, device):
        return _Pool()

    def capture(self, run, static_in, pool):
        self.captures += 1
        if self.fail is not None:
            raise self.fail
        if pool.used and pool.users == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        pool.used = True
        pool.users += 1
        out = run(static_in)
        graph = _Replayer(self, run, static_in, out, pool)
        self.graphs.append(graph)
        return graph, out, self.pool_bytes

    def pool_budget(self, device):
        return self.budget


@pytest.fixture
def model():
    m = tiny_vae()
    install.install_fast_path(m)
    # The first fused call of a model runs the warm-up; graphs wait for it, as on a GPU.
    _decode(m, _latent(), is_open=True)
    return m


@pytest.fixture
def standin(model, monkeypatch):
    backend = CpuStandIn(model)
    monkeypatch.setattr(cuda_graph, "BACKEND", backend)
    return backend


def _high(model, z):
    out, stats = _decode(model, z, is_open=True)
    return out, stats.fused_calls, dict(stats.fallbacks)


def _eager(model, z):
    """The same model's fast decode without graphs (what a replay must reproduce)."""
    previous, kl_settings.settings.cuda_graphs = kl_settings.settings.cuda_graphs, False
    try:
        return _decode(model, z, is_open=True)[0]
    finally:
        kl_settings.settings.cuda_graphs = previous


def test_second_decode_of_a_shape_captures_and_later_ones_replay(model, standin):
    z = _latent()
    eager, calls, fallbacks = _high(model, z)
    assert (standin.captures, standin.replays) == (0, 0)  # the first decode ran eagerly
    captured, calls2, _ = _high(model, z)
    assert (standin.captures, standin.replays) == (1, 1)
    z2 = _latent(seed=7)
    replayed, calls3, fallbacks3 = _high(model, z2)
    assert (standin.captures, standin.replays) == (1, 2)
    assert torch.equal(captured, eager)
    assert torch.equal(replayed, _eager(model, z2))
    # A replay reports what the decode did: every fused call, no fallback.
    assert calls == calls2 == calls3 > 1 and fallbacks == fallbacks3 == {}
    assert cuda_graph.graph_bytes(model) == standin.pool_bytes


def test_the_output_is_the_callers_own(model, standin):
    z = _latent()
    for _ in range(2):
        _high(model, z)
    first, _, _ = _high(model, z)
    kept = first.clone()
    _high(model, _latent(seed=3))
    assert torch.equal(first, kept)  # a later replay must not write into an earlier result


def test_shapes_keep_their_own_graphs_up_to_the_limit(model, standin):
    small, big, other = _latent(), _latent(shape=(1, 4, 8, 12)), _latent(shape=(2, 4, 8, 8))
    for z in (small, small, big, big):
        _high(model, z)
    assert standin.captures == 2
    _high(model, small)
    _high(model, big)
    assert (standin.captures, standin.replays) == (2, 4)
    for z in (other, other):  # a third shape: the least recently used graph goes
        _high(model, z)
    assert standin.captures == 3 and sum(g.was_reset for g in standin.graphs) == 1
    _high(model, small)
    assert standin.captures == 3 and standin.replays == 5


def _new_weight(model):
    conv = model.decoder.up_blocks[0].resnets[0].conv1
    conv.weight = torch.nn.Parameter(conv.weight * 1.5, requires_grad=False)  # set_attr_param does this


def _fold_dropped(model):
    cache.drop_fast_path_caches(model.decoder.up_blocks[0].upsamplers[0])  # rebuilt elsewhere


def _new_module(model):
    # An object patch (ComfyUI's set_attr) swapping a whole module: the fingerprint walks the
    # modules afresh on every decode.
    model.decoder.conv_out = copy.deepcopy(model.decoder.conv_out)


@pytest.mark.parametrize("change", [_new_weight, _fold_dropped, _new_module],
                         ids=["new-weight", "fold-dropped", "new-module"])
def test_a_change_between_decodes_is_decoded_eagerly_then_captured_again(model, standin, change):
    """The graph read the old tensors' addresses: never replayed after they changed."""
    z = _latent()
    _high(model, z)
    _high(model, z)
    change(model)
    out, _, _ = _high(model, z)
    assert standin.replays == 1 and standin.graphs[0].was_reset
    assert torch.equal(out, _eager(model, z))
    # The stale graph was the pool's only user: its memory is no longer counted, and the next
    # capture goes into a new pool (torch refuses a capture into a pool with no graph left).
    assert cuda_graph.graph_bytes(model) == 0
    _high(model, z)
    assert standin.captures == 2 and standin.replays == 2
    assert cuda_graph.graph_status(model) == ["captured"]
    assert standin.graphs[1].pool is not standin.graphs[0].pool
    _high(model, z)
    assert standin.replays == 3


def test_a_pool_shared_by_kept_graphs_is_kept(model, standin):
    """Two shapes share one pool; the stale one going leaves the pool to the other, and the
    recapture joins it (a new pool per capture would keep two decodes' activations)."""
    small, big = _latent(), _latent(shape=(1, 4, 8, 12))
    for z in (small, small, big, big):
        _high(model, z)
    assert standin.graphs[0].pool is standin.graphs[1].pool
    _fold_dropped(model)  # both graphs stale
    _high(model, small)  # the small one's graph goes; the big one's still holds the pool
    assert standin.graphs[1].pool.users == 1
    _high(model, small)
    assert standin.captures == 3 and standin.graphs[2].pool is standin.graphs[1].pool


def test_unload_drops_the_graphs(model, standin):
    z = _latent()
    _high(model, z)
    _high(model, z)
    assert cache.drop_fast_path_caches(model) > 0
    assert standin.graphs[0].was_reset and cuda_graph.graph_bytes(model) == 0
    _high(model, z)
    assert standin.replays == 1


def test_lossless_and_a_closed_gate_never_capture(model, standin):
    z = _latent()
    for _ in range(3):
        _decode(model, z, is_open=False)
        _decode(model, z)
    assert standin.captures == 0


@pytest.mark.parametrize("setting, value", [("upsample", "stock"), ("cuda_graphs", False)])
def test_a_setting_change_is_another_key(model, standin, monkeypatch, setting, value):
    z = _latent()
    _high(model, z)
    _high(model, z)
    monkeypatch.setattr(kl_settings.settings, setting, value)
    _high(model, z)
    assert standin.replays == 1


def test_weights_cast_per_call_decode_eagerly(model, standin, monkeypatch):
    z = _latent()
    _high(model, z)
    _high(model, z)
    conv = model.decoder.up_blocks[0].resnets[0].conv1
    monkeypatch.setattr(conv, "comfy_cast_weights", True, raising=False)  # ComfyUI low-VRAM mode
    for _ in range(3):
        _, _, fallbacks = _high(model, z)
        assert any("low-VRAM" in r for r in fallbacks)
    # The first decode after the switch replayed ahead (its Parameters still held where the
    # graph reads them), and the check dropped that output and the graph.
    assert (standin.captures, standin.replays) == (1, 2) and standin.graphs[0].was_reset


def test_comfyui_disable_cuda_graphs_is_honoured(model, standin, monkeypatch):
    fake = types.ModuleType("comfy.cli_args")
    fake.args = types.SimpleNamespace(disable_cuda_graphs=True)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", fake)
    z = _latent()
    for _ in range(3):
        _high(model, z)
    assert standin.captures == 0


def test_a_failed_capture_falls_back_for_that_shape_once(model, standin, caplog):
    standin.fail = RuntimeError("operation not permitted when stream is capturing")
    z = _latent()
    eager, calls, _ = _high(model, z)
    for _ in range(3):
        out, calls_after, fallbacks = _high(model, z)
        assert torch.equal(out, eager) and calls_after == calls and fallbacks == {}
    assert standin.captures == 1  # refused for this key from then on
    assert sum("CUDA graph capture failed" in r.getMessage() for r in caplog.records) <= 1


def test_a_pool_over_the_budget_is_not_kept(model, standin):
    standin.budget = standin.pool_bytes - 1
    z = _latent()
    for _ in range(3):
        _high(model, z)
    assert standin.captures == 1 and standin.replays == 0 and standin.graphs[0].was_reset
    assert cuda_graph.graph_bytes(model) == 0


def test_a_fold_built_during_the_capture_throws_it_away(model, standin, monkeypatch):
    capture = standin.capture

    def building(run, static_in, pool):
        result = capture(run, static_in, pool)
        cache._bump()  # what a fold built inside the capture does
        return result

    monkeypatch.setattr(standin, "capture", building)
    z = _latent()
    expected, _, _ = _high(model, z)
    out, _, _ = _high(model, z)
    assert torch.equal(out, expected) and standin.replays == 0 and standin.graphs[0].was_reset


# --- the Wan decode loop's first call (``families/wan/first_call.py``) -----------------------

WAN_CASES = [
    (1, 4, 3, 4, 6),  # a video: the replayed first call's frame cache feeds two eager chunks
    (1, 4, 1, 4, 6),  # one latent frame: the first call is the whole decode
]


@pytest.fixture
def wan_model():
    from support.wan_models import tiny_wan

    m = tiny_wan("wan21")
    install.install_fast_path(m)
    # The first fused call (inside the loop's first call) runs the warm-up; graphs wait for it.
    _wan_high(m, torch.zeros(1, 4, 1, 2, 2), graphs=False)
    return m


def _wan_high(model, z, graphs=True):
    from fast_vae_decode.fastpath.families.wan import settings as wan_settings

    previous, wan_settings.settings.cuda_graphs = wan_settings.settings.cuda_graphs, graphs
    try:
        with torch.no_grad(), gate_for(model).opened(True) as stats:
            return model.decode(z).sample, stats.fused_calls, dict(stats.fallbacks)
    finally:
        wan_settings.settings.cuda_graphs = previous


@pytest.mark.parametrize("shape", WAN_CASES, ids=["x".join(map(str, s)) for s in WAN_CASES])
def test_wan_first_call_captures_then_replays_the_eager_result(wan_model, monkeypatch, shape):
    from support.wan_models import latent

    backend = CpuStandIn(wan_model)
    monkeypatch.setattr(cuda_graph, "BACKEND", backend)
    eager, calls, fallbacks = _wan_high(wan_model, latent(shape))  # compiles, runs the warm-up
    assert fallbacks == {} and backend.captures == 0
    _wan_high(wan_model, latent(shape))  # seen once with these weights: captured
    assert (backend.captures, backend.replays) == (1, 1)
    for seed in (1, 2):
        z = latent(shape, seed=seed)
        replayed, calls_replayed, fallbacks = _wan_high(wan_model, z)
        assert torch.equal(replayed, _wan_high(wan_model, z, graphs=False)[0])
        assert calls_replayed == calls and fallbacks == {}
    assert (backend.captures, backend.replays) == (1, 3)
    assert cuda_graph.graph_status(wan_model.decoder) == ["replayed"]
    assert cache.drop_fast_path_caches(wan_model) > 0 and backend.graphs[0].was_reset


def test_wan_lossless_and_the_default_settings_never_capture(wan_model, monkeypatch):
    """Lossless (a closed gate) never; high only where the setting is on (off by default:
    the pool kept between decodes would put the decode's peak over stock's)."""
    from fast_vae_decode.fastpath.families.wan import settings as wan_settings
    from support.wan_models import latent

    backend = CpuStandIn(wan_model)
    monkeypatch.setattr(cuda_graph, "BACKEND", backend)
    z = latent(WAN_CASES[0])
    assert wan_settings.WanSettings().cuda_graphs is False
    for _ in range(3):
        with torch.no_grad(), gate_for(wan_model).opened(True):
            wan_model.decode(z)
    monkeypatch.setattr(wan_settings.settings, "cuda_graphs", True)
    for _ in range(3):
        with torch.no_grad(), gate_for(wan_model).opened(False):
            wan_model.decode(z)
    assert backend.captures == 0


# ---------------------------------------------------------------------------------------------
# Weights ComfyUI places (dynamic VRAM, ComfyUI 0.33's default): it puts a VAE's weights at new
# places whenever another model was loaded in between, so the graph and the folds read copies
# the decoder keeps, compared bit for bit with what ComfyUI hands over anew
# (``cuda_graph._use_copies``). ComfyUI's ops are simulated by a ``comfy.ops`` module whose
# ``cast_bias_weight`` hands out slots and force-loaded weights as ComfyUI's does: the same
# tensors while resident, new ones once the model was prepared again.
# Tier 3 (``tests/comfyui/test_comfyui_main_gpu.py``) runs it on ComfyUI itself on a GPU.

WEIGHTED = (torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.Linear)


class _Slots:
    """The decoder's weighted modules as dynamic VRAM leaves them. Convs and linears have a VRAM
    slot: their Parameters are NaN placeholders, the real weights live in ``real``, and a fetch
    faults them into new slot tensors when none is resident. GroupNorms and the head conv are
    force-loaded: their own Parameters on the device, handed back by the cast (the head's kept in
    fp64, the model's dtype, so cast per call). ``evict()`` is another model's load:
    the slots go, and the force-loaded Parameters are put back as new objects."""

    def __init__(self, model, monkeypatch, events=None):
        self.real, self.faults, self.open, self.slotted, self.forced = {}, 0, 0, [], []
        self.most_open = 0  # the most slots pinned at once
        self.events = [] if events is None else events
        ops = types.ModuleType("comfy.ops")

        def forward_comfy_cast_weights(*args, **kwargs):
            raise AssertionError("a stock forward under simulated slots")

        forward_comfy_cast_weights.__module__ = "comfy.ops"
        for cls in WEIGHTED:
            monkeypatch.setattr(cls, "forward_comfy_cast_weights", forward_comfy_cast_weights,
                                raising=False)
        ops.cast_bias_weight, ops.uncast_bias_weight = self._cast, self._uncast
        monkeypatch.setitem(sys.modules, "comfy.ops", ops)
        for m in model.decoder.modules():
            if not isinstance(m, WEIGHTED):
                continue
            monkeypatch.setattr(m, "comfy_cast_weights", True, raising=False)
            if isinstance(m, torch.nn.GroupNorm) or m is model.decoder.conv_out:
                self.forced.append(m)
                if m is model.decoder.conv_out:  # kept in the model's dtype: cast per call
                    for k, p in list(m._parameters.items()):
                        m._parameters[k] = torch.nn.Parameter(p.detach().double(),
                                                              requires_grad=False)
                continue
            self.slotted.append(m)
            self.real[id(m)] = {k: p.detach().clone() for k, p in m._parameters.items()
                                if p is not None}
            for k, p in self.real[id(m)].items():
                m._parameters[k] = torch.nn.Parameter(torch.full_like(p, float("nan")),
                                                      requires_grad=False)
            m.__dict__["_v"] = ("slot",)

    def _cast(self, s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False,
              **kwargs):
        self.events.append("fetch")
        if "_v" not in s.__dict__:  # force-loaded: its own Parameters, cast where need be
            weight, bias = s._parameters["weight"], s._parameters.get("bias")
            want = dtype or input.dtype
            if weight.dtype != want:
                weight, bias = weight.to(want), None if bias is None else bias.to(want)
            return (weight, bias, None) if offloadable else (weight, bias)
        if "_v_weight" not in s.__dict__:
            self.faults += 1
            real = self.real[id(s)]
            s.__dict__["_v_weight"] = real["weight"].clone()
            s.__dict__["_v_bias"] = real["bias"].clone() if "bias" in real else None
        weight, bias = s.__dict__["_v_weight"], s.__dict__["_v_bias"]
        if offloadable:
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            return weight, bias, ("slot",)
        return weight, bias

    def _uncast(self, s, weight, bias, state):
        self.open -= 1

    def evict(self):
        for m in self.slotted:
            m.__dict__.pop("_v_weight", None)
            m.__dict__.pop("_v_bias", None)
        for m in self.forced:
            for k, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[k] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)

    def rewrite(self, scale):
        """Other bits for the next fault (a LoRA, another file)."""
        for real in self.real.values():
            real["weight"] = real["weight"] * scale

    def weight_bytes(self):
        tensors = [t for real in self.real.values() for t in real.values()]
        tensors += [p for m in self.forced for p in m._parameters.values() if p is not None]
        # The head's copy is of its cast (fp32), half its fp64 Parameters' bytes.
        return sum(t.numel() * min(t.element_size(), 4) for t in tensors)


@pytest.fixture
def slots(model, standin, monkeypatch):
    return _Slots(model, monkeypatch, standin.events)


def test_slots_faulted_in_anew_with_the_same_bits_keep_the_graph_and_the_folds(model, standin,
                                                                              slots):
    z = _latent()
    _high(model, z)
    _high(model, z)
    assert (standin.captures, standin.replays) == (1, 1)
    faults, folds = slots.faults, cache.generation()
    norm = slots.forced[0].weight
    slots.evict()  # another model loaded
    replayed, _, fallbacks = _high(model, z)
    assert slots.forced[0].weight is not norm
    assert cuda_graph.graph_status(model) == ["replayed"], fallbacks
    assert (standin.captures, standin.replays) == (1, 2)
    assert cache.generation() == folds  # nothing rebuilt
    assert slots.faults > faults and slots.open == 0  # fetched anew, every fetch given back
    assert torch.equal(replayed, _eager(model, z))


def test_slots_with_other_bits_make_new_copies_and_a_new_graph(model, standin, slots):
    z = _latent()
    _high(model, z)
    before, _, _ = _high(model, z)
    slots.rewrite(0.75)
    slots.evict()
    changed, _, fallbacks = _high(model, z)
    # The stale graph ran ahead of the fetch (its copies are still the decoder's), and its
    # output was dropped once the check found other bits.
    assert fallbacks == {} and standin.replays == 2 and standin.graphs[0].was_reset
    assert not torch.equal(changed, before)
    _high(model, z)
    assert (standin.captures, standin.replays) == (2, 3)
    replayed, _, _ = _high(model, z)
    assert standin.replays == 4 and torch.equal(replayed, changed)
    assert torch.equal(replayed, _eager(model, z))


def test_a_graph_of_copies_replays_before_its_weights_are_fetched(model, standin, slots):
    """The host fetches and checks the weights while the graph runs (``_replay_ahead``)."""
    z = _latent()
    _high(model, z)
    _high(model, z)
    slots.evict()  # new slot tensors, the same bits: the check passes after the replay
    del standin.events[:]
    replayed, _, _ = _high(model, z)
    assert cuda_graph.graph_status(model) == ["replayed"] and standin.events.count("replay") == 1
    # Only the decoder's own ends (conv_in, norm_out, conv_out) are fetched before: its checks
    # run before the graph is looked up. Every block's weights are fetched while it runs.
    before = standin.events[:standin.events.index("replay")].count("fetch")
    after = standin.events.count("fetch") - before
    assert before <= 3 < after
    assert torch.equal(replayed, _eager(model, z))


def _log_fetches(monkeypatch, events):
    fetch = cuda_graph.call_tensors

    def logged(module, x):
        events.append("fetch")
        return fetch(module, x)

    monkeypatch.setattr(cuda_graph, "call_tensors", logged)


def test_a_graph_reading_comfyuis_tensors_in_place_replays_before_they_are_fetched(
        model, standin, monkeypatch):
    """Weights read in place (0.8, legacy loading): while every tensor the graph reads is the
    same live object at its address, the graph runs while the host fetches and checks them."""
    z = _latent()
    _high(model, z)
    _high(model, z)
    _log_fetches(monkeypatch, standin.events)
    del standin.events[:]
    replayed, _, _ = _high(model, z)
    assert cuda_graph.graph_status(model) == ["replayed"] and standin.events.count("replay") == 1
    assert standin.events.index("replay") == 0  # before any of the fetch's lookups
    assert standin.events.count("fetch") > 3
    assert torch.equal(replayed, _eager(model, z))


def _weight_replaced(conv):
    conv.weight = torch.nn.Parameter(conv.weight.detach().clone(), requires_grad=False)


def _weight_moved(conv):
    conv.weight.data = conv.weight.data.clone()  # the same object at a new address


@pytest.mark.parametrize("change", [_weight_replaced, _weight_moved], ids=["replaced", "moved"])
def test_a_graph_reading_comfyuis_own_tensors_waits_for_the_check_once_one_moved(model, standin,
                                                                                change):
    """A tensor read in place that was freed, or whose object now holds other memory: the graph
    could read memory ComfyUI has freed, so it replays only after the check (which finds it
    stale). The stand-in fails any replay that reads a freed tensor."""
    z = _latent()
    _high(model, z)
    _high(model, z)
    change(model.decoder.conv_in)
    out, _, _ = _high(model, z)
    assert standin.replays == 1  # the capture's own replay only: none ahead of the check
    assert cuda_graph.graph_status(model) != ["replayed"]  # decoded eagerly (stale graph gone)
    assert torch.equal(out, _eager(model, z))


def test_the_copies_are_counted_and_go_with_the_graphs(model, standin, slots):
    z = _latent()
    _high(model, z)
    _high(model, z)
    assert cuda_graph.graph_bytes(model) == standin.pool_bytes + slots.weight_bytes()
    assert cache.drop_fast_path_caches(model) > 0
    assert cuda_graph.graph_bytes(model) == 0


def test_a_shape_refused_a_graph_keeps_no_copies(model, standin, slots):
    standin.budget = standin.pool_bytes  # the pool alone fits; with the copies it does not
    z = _latent()
    for _ in range(3):
        _high(model, z)
    assert standin.captures == 1 and standin.replays == 0
    assert cuda_graph.graph_bytes(model) == 0 and slots.open == 0


def test_a_shape_refused_a_graph_fetches_each_blocks_weights_as_it_runs(model, standin, slots):
    """Nothing needs every weight before an eager decode of a refused shape starts: each block
    fetches its own (and gives its slots back) as it runs, so the first kernels are issued
    before the last weights are fetched, not after all of them."""
    standin.budget = standin.pool_bytes
    z = _latent()
    _high(model, z)
    _high(model, z)  # the capture, not kept
    slots.most_open = 0
    out, _, fallbacks = _high(model, z)
    assert cuda_graph.graph_status(model) == ["refused for this shape"] and fallbacks == {}
    assert standin.captures == 1 and standin.replays == 0
    assert 0 < slots.most_open < len(slots.slotted) and slots.open == 0
    assert torch.equal(out, _eager(model, z))
