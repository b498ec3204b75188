"""How the per-op benchmarks queue their calls (tier 1 on the CPU; one GPU check). Nothing here
asserts a time: the tests count calls and check what the spans are divided by."""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.bench import timing


class Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def test_explicit_calls_run_repeats_times_over_after_the_warmup():
    fn = Counter()
    times = timing.queued_ms(fn, "cpu", repeats=3, warmup=2, calls=5)
    assert len(times) == 3
    assert fn.calls == 2 + 3 * 5
    assert all(t >= 0.0 for t in times)


def test_one_span_is_divided_by_its_calls(monkeypatch):
    clock = iter([0.0, 0.010, 1.0, 1.004])  # two spans: 10 ms and 4 ms
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(timing, "timed_call", lambda fn, device: (1.0, fn()))
    times = timing.queued_ms(Counter(), "cpu", repeats=2, warmup=1, calls=4)
    assert times == pytest.approx([2.5, 1.0])


@pytest.mark.parametrize("single_ms, expected_calls", [
    (0.005, timing._QUEUE_MAX_CALLS),  # a µs op: capped, the sleep must outlast the queueing
    (0.5, 4),                          # fills the span
    (7.0, 1),                          # an op of milliseconds runs once per repeat
])
def test_unset_calls_follow_the_last_warmup_call(monkeypatch, single_ms, expected_calls):
    monkeypatch.setattr(timing, "timed_call", lambda fn, device: (single_ms, fn()))
    fn = Counter()
    timing.queued_ms(fn, "cpu", repeats=2, warmup=1)
    assert fn.calls == 1 + 2 * expected_calls


def test_a_zero_warmup_still_sizes_an_unset_queue_from_one_call(monkeypatch):
    monkeypatch.setattr(timing, "timed_call", lambda fn, device: (0.5, fn()))
    fn = Counter()
    timing.queued_ms(fn, "cpu", repeats=1, warmup=0)
    assert fn.calls == 1 + 4
    fn = Counter()
    timing.queued_ms(fn, "cpu", repeats=1, warmup=0, calls=3)
    assert fn.calls == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_queued_calls_on_the_gpu_all_run():
    x = torch.zeros(1024, device="cuda")

    def add_one():
        x.add_(1.0)

    times = timing.queued_ms(add_one, "cuda", repeats=2, warmup=1, calls=7)
    torch.cuda.synchronize()
    assert len(times) == 2 and all(t > 0.0 for t in times)
    assert x[0].item() == 1 + 2 * 7
