"""The gate: per model, weakly held, restored after nesting and exceptions, per thread."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from fast_vae_decode.fastpath.gate import decoder_models, existing_gate, gate_for, gates_opened


def test_closed_by_default_and_one_gate_per_model():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert gate_for(a) is gate_for(a)
    assert gate_for(a) is not gate_for(b)
    assert not gate_for(a).is_open


def test_nesting_and_exceptions_restore_previous_state():
    gate = gate_for(torch.nn.Linear(2, 2))
    with gate.opened(True):
        assert gate.is_open
        with gate.opened(False):
            assert not gate.is_open
        assert gate.is_open
        with pytest.raises(RuntimeError):
            with gate.opened(False):
                raise RuntimeError("boom")
        assert gate.is_open
    assert not gate.is_open


def test_stats_are_per_decode():
    gate = gate_for(torch.nn.Linear(2, 2))
    with gate.opened(True) as outer:
        gate.stats.fused_calls += 1
        with gate.opened(True) as inner:
            gate.stats.fell_back("why")
        assert inner.fallbacks == {"why": 1} and inner.fused_calls == 0
        assert outer.fused_calls == 1 and not outer.fallbacks


def test_gate_does_not_keep_the_model_alive():
    model = torch.nn.Linear(2, 2)
    gate_for(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_state_is_per_thread():
    gate = gate_for(torch.nn.Linear(2, 2))
    seen = []
    with gate.opened(True):
        t = threading.Thread(target=lambda: seen.append(gate.is_open))
        t.start()
        t.join()
    assert seen == [False]


def test_fast_path_never_allowed_while_compiling(monkeypatch):
    gate = gate_for(torch.nn.Linear(2, 2))
    with gate.opened(True):
        assert gate.allows_fast_path()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not gate.allows_fast_path()


class _ComfyLikeVAE:
    """Stands in for comfy.sd.VAE: the network lives in ``first_stage_model``."""

    def __init__(self):
        self.first_stage_model = torch.nn.Linear(2, 2)


def test_decoder_models_behind_wrappers():
    vae = _ComfyLikeVAE()
    assert decoder_models(vae) == [vae.first_stage_model]
    module = torch.nn.Linear(2, 2)
    assert decoder_models(module) == [module]
    assert decoder_models(object()) == []


def test_gates_opened_covers_every_decoder_model():
    vae = _ComfyLikeVAE()
    with gates_opened(vae, True) as stats:
        assert gate_for(vae.first_stage_model).is_open and len(stats) == 1
    assert not existing_gate(vae.first_stage_model).is_open
