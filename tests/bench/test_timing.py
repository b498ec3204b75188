"""``bench.timing.measure`` on CUDA, with the CUDA calls recorded (tier 1: no GPU): where the
allocator's cache is emptied against where the peak is taken."""
from __future__ import annotations

import torch

from fast_vae_decode.bench import timing


def test_each_path_is_measured_from_an_emptied_allocator_cache(monkeypatch):
    calls = []
    fake = {
        "empty_cache": lambda: calls.append("empty_cache"),
        "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: calls.append("reset_peak"),
        "memory_allocated": lambda device=None: 100,
        "max_memory_allocated": lambda device=None: 150,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(timing, "timed_call", lambda fn, device: (1.0, fn()))

    def decode():
        calls.append("decode")
        return "pixels"

    result = timing.measure(decode, "cuda", repeats=2, warmup=1)
    # The cache is emptied before the warm-up (which refills it the path's own way), and the
    # peak is taken over the timed calls only.
    assert calls == ["empty_cache", "decode", "reset_peak", "decode", "decode"]
    assert result.peak_extra_bytes == 50 and result.times_ms == [1.0, 1.0]
    assert result.output == "pixels"
