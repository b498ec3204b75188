"""Whether a decode's ``exp_scores`` attention stayed in range, asked once the decode is done.

``kernels.vae_attention.attention_exp_scores`` cannot repair a row whose scores lie far above
its sampled reference; it sets a flag on the device instead (no host sync inside the decode,
which may be replayed from a CUDA graph). The fused decoder watches each decode: the flag is
cleared before it, and read after it only when the decode, or the eager run or capture of
the graph it replays, had an attention take that path. A tripped decode is run again with
that path suspended (the chunked softmax), so the output is always an in-range attention's.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch


class ExpScoresGuard:
    def __init__(self) -> None:
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._local = threading.local()
        # Decode keys (shape, dtype, device, settings) whose attention took the path: a
        # graph's replay runs no Python, so its eager run or capture says it for it.
        self._keys_using: set[tuple] = set()

    @property
    def suspended(self) -> bool:
        """True inside ``suspend()``: attention keeps the softmax path."""
        return getattr(self._local, "suspended", False)

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        previous = self.suspended
        self._local.suspended = True
        try:
            yield
        finally:
            self._local.suspended = previous

    def flag(self, device: torch.device) -> torch.Tensor:
        """The device's flag, for an attention taking the path now (noted for this decode).
        Kept for the process: a captured graph writes to its address."""
        self._local.used = True
        flag = self._flags.get(device)
        if flag is None:
            # A normal tensor even when first asked inside inference mode (ComfyUI's decodes
            # and the warm-up): decodes outside it clear it in place too.
            with torch.inference_mode(False):
                flag = self._flags[device] = torch.zeros((), dtype=torch.bool, device=device)
        return flag

    @contextlib.contextmanager
    def watch(self, key: tuple, device: torch.device) -> Iterator[list[bool]]:
        """Around one decode; the yielded list holds, after the block, whether it tripped."""
        flag = self._flags.get(device)
        if flag is not None:
            flag.zero_()
        outer = getattr(self._local, "used", None)
        self._local.used = False
        result = [False]
        try:
            yield result
            if self._local.used:
                self._keys_using.add(key)
            if key in self._keys_using:
                flag = self._flags.get(device)
                result[0] = flag is not None and bool(flag.item())
        finally:
            self._local.used = outer


exp_scores_guard = ExpScoresGuard()
