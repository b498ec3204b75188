"""The installer framework, proven with a small test family (the real families have their own).

The test family fuses GroupNorm + the SiLU after it into one module whose fast path computes in
channels-last; it is deliberately not bit-exact (it adds 1e-3), so a test can tell which path
ran, while the closed gate must be ``torch.equal`` with the untouched model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fast_vae_decode.fastpath import cache, install, quality
from fast_vae_decode.fastpath.fused import FusedModule
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.swap import is_swapped, swap_in


class Block(torch.nn.Module):
    def __init__(self, c, groups):
        super().__init__()
        self.norm = torch.nn.GroupNorm(groups, c)
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.silu(self.norm(x)))


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList([Block(8, 4), Block(8, 4), Block(8, 8)])
        self.conv_out = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for b in self.blocks:
            h = b(h)
        return self.conv_out(h)


class FusedTestBlock(FusedModule):
    def fast_unsupported(self, x):
        return "odd test shape" if x.shape[-1] % 2 else None

    def fast_forward(self, x):
        w = cache.cached(self, "scaled", (self.conv.weight,), lambda: self.conv.weight * 1.0)
        h = F.silu(self.norm(x.contiguous(memory_format=torch.channels_last)))
        return x + F.conv2d(h, w, self.conv.bias, padding=1) + 1e-3


def _install(model, gate, report):
    for name, m in model.named_modules():
        if isinstance(m, Block):
            if m.norm.num_groups == 8:  # fail closed per module: the test "kernel" takes <= 4 groups
                report.skipped[name] = "8 groups"
                continue
            if swap_in(m, FusedTestBlock, _fvd_gate=gate):
                report.fused += 1


@pytest.fixture
def test_family():
    install.register_family(install.Family("test", lambda m: isinstance(m, TinyDecoder), _install))
    yield
    install.unregister_family("test")


def _model():
    torch.manual_seed(0)
    return TinyDecoder().eval()


def test_install_keeps_state_dict_and_is_idempotent(test_family):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    report = install.install_fast_path(model)
    assert report.family == "test" and report.fused == 2
    assert report.skipped == {"blocks.2": "8 groups"}
    assert "2 fused modules" in report.summary() and "1 left stock" in report.summary()
    assert install.install_fast_path(model) is report
    assert [n for n, _ in model.named_parameters()] == names
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sum(is_swapped(m) for m in model.modules()) == 2


def test_closed_gate_is_bit_exact_open_gate_takes_fast_path(test_family):
    model = _model()
    stock = copy.deepcopy(model)
    install.install_fast_path(model)
    z = torch.randn(1, 4, 6, 6)
    with torch.inference_mode():
        expected = stock(z)
        assert torch.equal(model(z), expected)
        with gate_for(model).opened(True) as stats:
            fast = model(z)
        assert stats.fused_calls == 2
        assert not torch.equal(fast, expected)
        torch.testing.assert_close(fast, expected, atol=1e-2, rtol=0)
        assert torch.equal(model(z), expected)  # nothing stays changed after the gate closes


def test_load_state_dict_into_installed_model(test_family):
    model, other = _model(), TinyDecoder()
    install.install_fast_path(model)
    model.load_state_dict(other.state_dict())
    z = torch.randn(1, 4, 4, 4)
    assert torch.equal(model(z), other(z))


def test_caches_are_lazy_not_in_state_dict_and_dropped(test_family):
    model = _model()
    install.install_fast_path(model)
    assert cache.cache_bytes(model) == 0
    with gate_for(model).opened(True):
        model(torch.randn(1, 4, 4, 4))
    assert cache.cache_bytes(model) > 0
    assert not any("cache" in k for k in model.state_dict())
    assert cache.drop_fast_path_caches(model) == 2
    assert cache.cache_bytes(model) == 0


def test_cache_rebuilds_when_source_changes(test_family):
    module = torch.nn.Linear(2, 2)
    builds = []
    for _ in range(2):
        cache.cached(module, "w", (module.weight,), lambda: builds.append(1) or module.weight * 2)
    assert len(builds) == 1
    with torch.no_grad():
        module.weight.add_(1)  # bumps the version counter: a loaded checkpoint must not reuse a fold
    cache.cached(module, "w", (module.weight,), lambda: builds.append(1) or module.weight * 2)
    assert len(builds) == 2


def test_per_call_fallback_is_counted_and_exact(test_family):
    model = _model()
    stock = copy.deepcopy(model)
    install.install_fast_path(model)
    z = torch.randn(1, 4, 5, 5)  # odd width: the test module refuses it
    with gate_for(model).opened(True) as stats:
        out = model(z)
    assert stats.fused_calls == 0 and stats.fallbacks == {"odd test shape": 2}
    assert torch.equal(out, stock(z))


def test_broken_fast_path_returns_stock_result_and_disables_module(test_family, monkeypatch):
    model = _model()
    stock = copy.deepcopy(model)
    install.install_fast_path(model)

    def broken(self, x):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(FusedTestBlock, "fast_forward", broken)
    z = torch.randn(1, 4, 4, 4)
    with gate_for(model).opened(True) as stats:
        out = model(z)
    assert torch.equal(out, stock(z))
    assert stats.fallbacks == {"kernel error in FusedTestBlock[Block]": 2}
    assert all(m._fvd_disabled for m in model.modules() if is_swapped(m))


def test_unsupported_model_reports_why():
    report = install.install_fast_path(torch.nn.Linear(2, 2))
    assert not report.installed and report.reason == "unsupported VAE (Linear)"


def test_install_failure_fails_closed(test_family):
    def explode(model, gate, report):
        raise RuntimeError("surprise structure")

    install.register_family(install.Family("test", lambda m: isinstance(m, TinyDecoder), explode))
    report = install.install_fast_path(_model())
    assert not report.installed and "surprise structure" in report.reason


class _VAE:
    def __init__(self, model):
        self.first_stage_model = model

    def decode(self, z):
        return self.first_stage_model(z)


def test_decode_at_quality_outcomes(test_family, monkeypatch):
    vae = _VAE(_model())
    stock = copy.deepcopy(vae.first_stage_model)
    z = torch.randn(1, 4, 4, 4)
    out, outcome = quality.decode_at_quality(vae, "lossless", lambda: vae.decode(z))
    assert torch.equal(out, stock(z)) and outcome.text() == "lossless"
    out, outcome = quality.decode_at_quality(vae, "high", lambda: vae.decode(z))
    assert outcome.path == "high" and outcome.text() == "high: 2 fused modules"
    monkeypatch.setattr(quality, "triton_unavailable_reason", lambda x=None: "no Triton (test)")
    out, outcome = quality.decode_at_quality(vae, "high", lambda: vae.decode(z))
    assert torch.equal(out, stock(z)) and outcome.text() == "fallback: no Triton (test)"
    with pytest.raises(ValueError, match="high, lossless"):
        quality.decode_at_quality(vae, "best", lambda: vae.decode(z))
    assert not gate_for(vae.first_stage_model).is_open


def test_deep_copy_of_an_installed_model_gets_its_own_gate(test_family):
    model = _model()
    stock = copy.deepcopy(model)
    install.install_fast_path(model)
    twin = copy.deepcopy(model)
    assert install.install_fast_path(twin).fused == 2
    z = torch.randn(1, 4, 4, 4)
    with gate_for(model).opened(True):
        assert torch.equal(twin(z), stock(z))  # the original's open gate is not the twin's
    with gate_for(twin).opened(True) as stats:
        twin(z)
    assert stats.fused_calls == 2


def test_a_model_at_a_freed_models_address_still_reports_its_install(test_family, monkeypatch, caplog):
    """Python reuses a freed object's id(): every model must log its own install line, even
    when ids repeat (made deterministic here: every id() in install.py is the same number)."""
    from fast_vae_decode.fastpath import log

    monkeypatch.setattr(log, "_SAID", set())
    monkeypatch.setattr(install, "id", lambda obj: 7, raising=False)
    caplog.set_level("INFO", logger="fast_vae_decode")
    for _ in range(2):
        install.install_fast_path(_model())
    assert sum("TinyDecoder: test: " in r.getMessage() for r in caplog.records) == 2
