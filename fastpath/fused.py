"""The mixin every fused module shares: gate check, per-call fail-closed, broken-kernel guard.

A fused module is a stock module whose class was swapped (see ``swap.py``) for
``Mixin + StockClass``. Its ``forward`` runs ``fast_forward`` only while the model's gate is
open and the module can take the input; otherwise it runs the stock ``forward`` unchanged.
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..kernels.backend import start_compiler_key
from .cache import drop_fast_path_caches
from .comfyui.weights import STREAMED, weights_for_call
from .log import log_once, say
from .prewarm import tiny_input, warm_up

DISABLED = "fast path disabled after a kernel error"


class FusedModule:
    """Mixin; subclasses define ``fast_unsupported(*args)`` and ``fast_forward(*args)``."""

    _fvd_gate = None  # set per instance at install; absent means "never fast"
    _fvd_disabled: str | None = None

    def fast_unsupported(self, *args, **kwargs) -> str | None:
        return None

    def fast_forward(self, *args, **kwargs):
        raise NotImplementedError

    # Kernel warm-up (``prewarm.py``): a module that declares the channel count of its input
    # runs its fast path once on a tiny input of rank ``_fvd_prewarm_rank``; modules with the
    # same class and parameter shapes launch the same kernel variants, so one of them does.
    _fvd_prewarm_rank = 4

    def prewarm_channels(self) -> int | None:
        return None

    def prewarm_first(self) -> bool:
        """Whether this module records ahead of the others: one that launches a kernel built
        on ``tl.dot`` (the pack's own convs), whose compile is the longest of a warm-up."""
        return False

    def prewarm_key(self):
        if self.prewarm_channels() is None:
            return None
        return type(self), tuple(tuple(p.shape) for p in self.parameters())

    def prewarm(self, device: torch.device, dtype: torch.dtype) -> None:
        """Run the fast path once on a tiny input so its Triton kernels get compiled."""
        self.prewarm_call(tiny_input(self.prewarm_channels(), self._fvd_prewarm_rank, device, dtype))

    def prewarm_call(self, *args, **kwargs) -> None:
        """One warm-up call: the fast path on these arguments, where it takes them."""
        with weights_for_call():
            if self.fast_unsupported(*args, **kwargs) is None:
                self.fast_forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        gate = self._fvd_gate
        if gate is None or not gate.allows_fast_path():
            return super().forward(*args, **kwargs)
        if self._fvd_disabled is not None:
            gate.stats.fell_back(DISABLED)
            return super().forward(*args, **kwargs)
        # The weights a fused call reads are fetched (by its checks) the way ComfyUI's ops
        # fetch them, and given back when the call ends, before any stock fallback fetches
        # them again its own way.
        with weights_for_call():
            reason = self.fast_unsupported(*args, **kwargs)
            if reason is None:
                if gate.prewarm_modules is not None:  # the model's first fused call
                    warm_up(gate, args[0] if args else None)
                try:
                    out = self.fast_forward(*args, **kwargs)
                except torch.OutOfMemoryError:
                    raise  # ComfyUI's decode retries tiled on OOM; swallowing it would defeat that
                except Exception as exc:  # a broken kernel must never lose the result
                    out, failure = None, exc
                else:
                    failure = None
        if reason is not None:
            if reason == STREAMED:
                # ComfyUI evicted this module's weights from VRAM: folds of the resident copy
                # are stale and only hold memory the memory manager wanted back.
                drop_fast_path_caches(self)
            gate.stats.fell_back(reason)
            log_once(f"fallback:{type(self).__name__}:{reason}",
                     f"{type(self).__name__}: stock path ({reason})")
            return super().forward(*args, **kwargs)
        if failure is not None:
            self._fvd_disabled = f"{type(failure).__name__}: {failure}".splitlines()[0][:200]
            gate.stats.fell_back(f"kernel error in {type(self).__name__}")
            gate.stats.kernel_errors.append(type(self).__name__)
            # Said here, unkeyed: a module is disabled once, and an id() key would silence a
            # later module that reuses a freed one's address.
            say(f"{type(self).__name__}: fast path raised ({self._fvd_disabled}); "
                "disabled for this module for the session, using the stock path", logging.WARNING)
            return super().forward(*args, **kwargs)
        gate.stats.fused_calls += 1
        return out


def arm_prewarm(gate, model: torch.nn.Module) -> None:
    """Remember ``model``'s fused modules on its gate; the first fused call warms them up."""
    modules = [m for m in model.modules() if isinstance(m, FusedModule)]
    gate.prewarm_modules = weakref.WeakSet(modules) if modules else None
    if modules and torch.cuda.is_available():
        start_compiler_key()  # hashed while ComfyUI loads the model and the decode starts
