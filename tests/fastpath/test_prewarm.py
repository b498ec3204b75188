"""Kernel warm-up before a model's first fused decode (``fastpath/prewarm.py``).

Tier 1 (CPU): the same code path runs with "cpu" added to the warm-up device types, one worker
thread (the Triton interpreter is not thread-safe): install arms the gate, the first fused call
warms every distinct module once, the decode result is exactly what it is without warm-up, and a
module whose warm-up raises changes nothing. (Tier 3, where after warm-up the first real decode
on a GPU compiles no new kernel variant, is in test_prewarm_gpu.py.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from fast_vae_decode.fastpath import prewarm
from fast_vae_decode.fastpath.families.kl.modules import _FusedResnet
from fast_vae_decode.fastpath.families.wan.modules import FusedWanResidualBlock
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path

diffusers = pytest.importorskip("diffusers")
from support.kl_models import _decode, _latent, tiny_vae  # noqa: E402
from support.wan_models import latent as wan_latent  # noqa: E402
from support.wan_models import tiny_wan  # noqa: E402


@pytest.fixture
def cpu_warmup(monkeypatch):
    monkeypatch.setattr(prewarm, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(prewarm, "MAX_WORKERS", 1)


def _count_calls(monkeypatch, cls) -> list:
    calls = []
    original = cls.prewarm

    def counting(self, device, dtype):
        calls.append(type(self).__name__)
        return original(self, device, dtype)

    monkeypatch.setattr(cls, "prewarm", counting)
    return calls


def test_install_arms_the_gate_and_the_first_fused_call_disarms_it(cpu_warmup, monkeypatch):
    model = tiny_vae()
    install_fast_path(model)
    gate = gate_for(model)
    assert gate.prewarm_modules is not None and len(gate.prewarm_modules) > 0
    calls = _count_calls(monkeypatch, _FusedResnet)
    _decode(model, _latent(), True)
    assert gate.prewarm_modules is None
    # The tiny decoder's resnet blocks have 3 distinct (in, out) widths: one warm-up each.
    assert len(calls) == 3 and all(c.startswith("FusedDiffusersResnetBlock2D") for c in calls)
    _decode(model, _latent(), True)
    assert len(calls) == 3  # once per model


def test_a_closed_gate_never_warms_up(cpu_warmup):
    model = tiny_vae()
    install_fast_path(model)
    _decode(model, _latent(), False)
    assert gate_for(model).prewarm_modules is not None


def test_warm_up_does_not_change_the_result(cpu_warmup):
    warmed, cold = tiny_vae(), tiny_vae()
    for m in (warmed, cold):
        install_fast_path(m)
    gate_for(cold).prewarm_modules = None
    z = _latent()
    assert torch.equal(_decode(warmed, z, True)[0], _decode(cold, z, True)[0])


def test_a_failing_warm_up_is_skipped(cpu_warmup, monkeypatch, caplog):
    def broken(self, device, dtype):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(_FusedResnet, "prewarm", broken)
    model, reference = tiny_vae(), tiny_vae()
    install_fast_path(model)
    install_fast_path(reference)
    gate_for(reference).prewarm_modules = None
    z = _latent()
    with caplog.at_level("INFO", logger="fast_vae_decode"):
        out, stats = _decode(model, z, True)
    assert stats.kernel_errors == [] and stats.fused_calls > 0
    assert torch.equal(out, _decode(reference, z, True)[0])
    assert any("kernel warm-up" in r.getMessage() and "skipped" in r.getMessage()
               for r in caplog.records)


def test_wan_warm_up_leaves_the_frame_cache_alone(cpu_warmup, monkeypatch):
    warmed, cold = tiny_wan("wan21"), tiny_wan("wan21")
    for m in (warmed, cold):
        install_fast_path(m)
    gate_for(cold).prewarm_modules = None
    calls = _count_calls(monkeypatch, FusedWanResidualBlock)
    z = wan_latent((1, 4, 2, 4, 6))
    with torch.no_grad():
        with gate_for(warmed).opened(True):
            a = warmed.decode(z).sample
        with gate_for(cold).opened(True):
            b = cold.decode(z).sample
    assert calls and torch.equal(a, b)


def test_a_copied_model_gets_its_own_warm_up(cpu_warmup):
    model = tiny_vae()
    install_fast_path(model)
    _decode(model, _latent(), True)
    twin = copy.deepcopy(model)
    install_fast_path(twin)
    assert gate_for(twin).prewarm_modules is not None


def test_every_gate_reports_its_warm_up_even_at_a_reused_address(cpu_warmup, monkeypatch, caplog):
    """A later gate at a freed gate's address (id() repeats; made deterministic here) must
    still report its warm-up."""
    from fast_vae_decode.fastpath import log

    monkeypatch.setattr(log, "_SAID", set())
    monkeypatch.setattr(prewarm, "id", lambda obj: 7, raising=False)
    caplog.set_level("INFO", logger="fast_vae_decode")
    for _ in range(2):
        model = tiny_vae()
        install_fast_path(model)
        _decode(model, _latent(), True)
    assert sum("kernel warm-up:" in r.getMessage() for r in caplog.records) == 2


def test_recorded_launches_run_nothing_and_sizes_share_a_variant():
    """Under ``recording_launches`` a kernel wrapper launches nothing; two sizes of the same
    GroupNorm give one variant per kernel (sizes are never specialized)."""
    from fast_vae_decode.kernels.backend import launch, recording_launches, variant_key
    from fast_vae_decode.kernels.group_norm_silu import group_norm_silu

    weight, bias = torch.ones(64), torch.zeros(64)
    with recording_launches() as recorded:
        for size in (4, 12):
            x = torch.randn(1, 64, size, size).contiguous(memory_format=torch.channels_last)
            assert group_norm_silu(x, weight, bias, 8, 1e-6) is not None
    assert len(recorded) == 6  # stats, finalize, apply per call
    assert len({variant_key(r) for r in recorded}) == 3

    class NeverLaunched:
        def __getitem__(self, grid):
            raise AssertionError("launched while recording")

    with recording_launches() as recorded:
        launch(NeverLaunched(), (1,), torch.zeros(1), BLOCK=4)
    assert len(recorded) == 1


# --- Triton's own cache key, hashed once ahead of the compile threads ------------------------


@pytest.fixture
def compiler_key(monkeypatch):
    """A fresh once-per-process state, outside the interpreter, with a counting stand-in for
    Triton's ``triton_key`` (the real one hashes ~500 MB of libtriton)."""
    from fast_vae_decode.kernels import backend

    if backend.triton is None:
        pytest.skip("needs Triton")
    import triton.runtime.cache as triton_cache

    calls = []
    monkeypatch.setattr(triton_cache, "triton_key", lambda: calls.append(1) or "key")
    monkeypatch.setattr(backend, "_set_up_driver", lambda: calls.append("driver"))
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    monkeypatch.setattr(backend, "_COMPILER_KEY", {})
    return backend, calls


def test_the_driver_is_set_up_and_the_key_hashed_once_however_often_asked(compiler_key):
    """Once per process, on the key's own thread: Triton's driver first (its C helper's build
    waits on gcc), then the key."""
    backend, calls = compiler_key
    for _ in range(3):
        backend.start_compiler_key()
    backend.wait_compiler_key()
    backend.wait_compiler_key()
    assert calls == ["driver", 1]
    assert not backend._COMPILER_KEY["thread"].is_alive()


def test_waiting_hashes_the_key_when_nothing_started_it(compiler_key):
    backend, calls = compiler_key
    backend.wait_compiler_key()
    assert calls == ["driver", 1]


@pytest.mark.parametrize("cuda", [True, False])
def test_install_starts_hashing_the_key_only_on_a_cuda_host(compiler_key, monkeypatch, cuda):
    backend, calls = compiler_key
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    install_fast_path(tiny_vae())
    if cuda:
        backend.wait_compiler_key()
    assert calls == (["driver", 1] if cuda else []) and ("thread" in backend._COMPILER_KEY) == cuda


@pytest.mark.parametrize("device, cuda, started", [
    ("cuda", True, True),
    ("cpu", True, False),  # ComfyUI on the CPU (--cpu) on a GPU host: no CUDA context for it
    ("cuda", False, False),
])
def test_start_up_sets_triton_up_only_for_a_cuda_decode_device(compiler_key, monkeypatch, device,
                                                                cuda, started):
    from fast_vae_decode.fastpath.prewarm import start_triton_setup

    backend, calls = compiler_key
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert start_triton_setup(torch.device(device)) is started
    if started:
        backend._COMPILER_KEY["thread"].join()
    assert calls == (["driver", 1] if started else []) and ("thread" in backend._COMPILER_KEY) == started


def test_the_interpreter_never_hashes_the_key(compiler_key, monkeypatch):
    backend, calls = compiler_key
    monkeypatch.setattr(backend, "interpreting", lambda: True)
    backend.wait_compiler_key()
    assert backend._COMPILER_KEY == {} and calls == []


def test_compile_threads_start_only_after_the_key_is_hashed(cpu_warmup, monkeypatch):
    """Every compile waits for the key first (on its own thread: the recording of later
    modules goes on meanwhile), so no compile thread hashes Triton itself."""
    order = []
    monkeypatch.setattr(prewarm, "wait_compiler_key", lambda: order.append("key"))
    monkeypatch.setattr(prewarm, "start_compiler_key", lambda: None)
    monkeypatch.setattr(prewarm, "compile_launch", lambda record: order.append("compile"))
    model = tiny_vae()
    install_fast_path(model)
    _decode(model, _latent(), True)
    assert "compile" in order
    assert all(order[i - 1] == "key" for i, step in enumerate(order) if step == "compile")


@pytest.mark.parametrize("taps", [False, True], ids=["cpu-routes", "gpu-taps"])
@pytest.mark.parametrize("join", [False, True], ids=["own-first-call", "joined-first-call"])
@pytest.mark.parametrize("kind,shape", [("wan21", (1, 4, 3, 4, 6)), ("wan22", (1, 8, 3, 4, 6))])
def test_wan_warm_up_compiles_every_variant_a_cached_decode_meets(cpu_warmup, monkeypatch, kind,
                                                                  shape, join, taps):
    """Every kernel variant a decode launches (three latent frames: the first chunk and
    steady chunks reading the frame cache; the mid-block attention on the latent's frame size)
    was among those the warm-up compiled, so none is left to compile inside the first decode.
    Joined (``join_first_chunk``), Wan 2.2's shortcuts after the split temporal upsample once
    met an NCTHW input here: a variant of their own, and strided reads. ``gpu-taps``: the
    GPU's 2-D taps route up to ``TAPS_MAX_CHANNELS`` forced on the CPU. There, with three tap
    parts, a conv reading two cached frames in place (``split_tap_parts``) hands its norm one
    addend, which no warm-up call met (the GPU tier's failure at 7e325fb, docs/benchmark/s35)."""
    from fast_vae_decode.fastpath.families.wan import ops as wan_ops
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings
    from fast_vae_decode.kernels.backend import recording_launches, variant_key

    monkeypatch.setattr(wan_settings, "join_first_chunk", join)
    monkeypatch.setattr(wan_settings, "join_per_frame", join)
    if taps:
        monkeypatch.setattr(wan_ops, "_as_2d_taps",
                            lambda conv, inp: wan_ops.taps_2d_shape(conv, inp.shape))
    warmed = []
    monkeypatch.setattr(prewarm, "compile_launch", warmed.append)
    model = tiny_wan(kind)
    install_fast_path(model)
    gate = gate_for(model)
    z = wan_latent(shape)
    with torch.inference_mode(), gate.opened(True):
        model.decode(z)  # the first fused call warms up
        with recording_launches() as decoded:
            model.decode(z)
    missing = {variant_key(r) for r in decoded} - {variant_key(r) for r in warmed}
    assert warmed and decoded and not missing, [(k[0].fn.__name__, k[2]) for k in missing]


def test_compiles_start_while_later_modules_still_record(monkeypatch):
    """A variant goes to the compile pool once its module has recorded it: the compile threads
    work while the next modules record (not only after the last one)."""
    import threading

    monkeypatch.setattr(prewarm, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(prewarm, "MAX_WORKERS", 2)
    monkeypatch.setattr(prewarm.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(prewarm, "wait_compiler_key", lambda: None)
    compiling = threading.Event()
    monkeypatch.setattr(prewarm, "compile_launch", lambda record: compiling.set())
    seen_while_recording = []

    class LaterModule:  # stands in for the next module to record
        def prewarm(self, device, dtype):
            # Set by a compile thread; without pipelining nothing compiles until recording ends.
            seen_while_recording.append(compiling.wait(timeout=60))

    jobs = prewarm._jobs
    monkeypatch.setattr(prewarm, "_jobs", lambda modules: jobs(modules)[:1] + [LaterModule()])
    model = tiny_vae()
    install_fast_path(model)
    _decode(model, _latent(), True)
    assert seen_while_recording == [True]


@pytest.mark.parametrize("kind", ["wan21", "wan22"])
def test_the_pack_conv_of_the_wan_head_is_compiled_first(cpu_warmup, monkeypatch, kind):
    """The head conv leaves cuDNN for the pack's implicit-GEMM conv, the longest compile of a
    Wan warm-up: its module records first, so its variants reach the pool before the rest
    (recorded in decoder order it was handed over last, and the warm-up waited on it)."""
    compiled = []
    monkeypatch.setattr(prewarm, "compile_launch", compiled.append)
    model = tiny_wan(kind).to(torch.bfloat16)  # the pack's convs take bf16 / fp16 only
    install_fast_path(model)
    z = wan_latent((1, 4 if kind == "wan21" else 8, 3, 4, 6), dtype=torch.bfloat16)
    with torch.inference_mode(), gate_for(model).opened(True):
        model.decode(z)
    names = [record[0].fn.__name__ for record in compiled]
    assert "_implicit_gemm_conv_kernel" in names
    assert names[0] == "_implicit_gemm_conv_kernel", names


def _exp_scores_kernels():
    """Either exp_scores kernel: the pointer kernel (POINTER_CONFIG) or the TMA kernel
    (TMA_CONFIG, which falls back to the first where TMA cannot run), whichever
    EXP_SCORES_CONFIG names."""
    from fast_vae_decode.kernels import exp_scores
    return (exp_scores._exp_scores_kernel, exp_scores._exp_scores_tma_kernel)


@pytest.mark.parametrize("dtype, attention, auto_exp_scores, warmed", [
    (torch.bfloat16, "exp_scores", False, True),  # every decode takes it
    (torch.bfloat16, "auto", True, True),  # a 2048² decode will take it
    (torch.bfloat16, "auto", False, False),  # auto_exp_scores off: auto never takes it
    (torch.bfloat16, "chunked", True, False),  # never taken
    (torch.float32, "exp_scores", False, False),  # bf16 only
])
def test_the_kl_attention_warms_exp_scores_where_a_decode_may_take_it(
        monkeypatch, dtype, attention, auto_exp_scores, warmed):
    """The warm-up's tiny input takes SDPA, so the attention records the exp_scores kernel
    itself: a 2048² decode then finds it compiled. (No frame hint here: a warm-up outside a
    decode records it wherever a decode may take it.)"""
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings
    from fast_vae_decode.kernels.backend import recording_launches

    monkeypatch.setattr(kl_settings.settings, "attention", attention)
    monkeypatch.setattr(kl_settings.settings, "auto_exp_scores", auto_exp_scores)
    model = tiny_vae().to(dtype)
    install_fast_path(model)
    attention_module = model.decoder.mid_block.attentions[0]
    with recording_launches() as recorded, torch.inference_mode():
        attention_module.prewarm(torch.device("cpu"), dtype)
    assert any(r[0] in _exp_scores_kernels() for r in recorded) == warmed
    assert attention_module.prewarm_first() == (warmed or dtype != torch.bfloat16)


@pytest.mark.parametrize("latent, warmed", [
    ((256, 256), True),  # SDXL 2048²: 65536 tokens, auto takes exp_scores
    ((128, 128), False),  # 1024²: below the threshold, no compile spent on it
])
def test_auto_warms_exp_scores_only_for_a_latent_at_the_threshold(monkeypatch, latent, warmed):
    from fast_vae_decode.fastpath.families.kl import settings as kl_settings
    from fast_vae_decode.kernels.backend import recording_launches

    monkeypatch.setattr(kl_settings.settings, "attention", "auto")
    monkeypatch.setattr(kl_settings.settings, "auto_exp_scores", True)
    monkeypatch.setattr(kl_settings.settings, "exp_scores_min_tokens", 65536)
    model = tiny_vae().to(torch.bfloat16)
    install_fast_path(model)
    attention_module = model.decoder.mid_block.attentions[0]
    monkeypatch.setattr(prewarm._FRAME, "size", latent, raising=False)
    with recording_launches() as recorded, torch.inference_mode():
        attention_module.prewarm(torch.device("cpu"), torch.bfloat16)
    assert any(r[0] in _exp_scores_kernels() for r in recorded) == warmed
