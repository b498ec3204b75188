"""Launching an already compiled Triton kernel without Triton's per-call dispatch.

``kernel[grid](...)`` binds the arguments, specialises each, builds a cache key and looks the
compiled kernel up on every call. On the H200 host that is 13.5 us for a five-argument kernel,
and the norms' three launches with ~20 arguments each cost 111 us per call (Triton 3.6), while
at a decoder's 128² and 256² stages each kernel runs for 5-20 us: there the GPU waits on the
host (``profile``: SDXL 1024²'s host-late idle, ~4.5 ms of a 22 ms decode).

Here the first launch of each (kernel, signature) goes through Triton as usual and the compiled
kernel it used is kept; later launches with the same signature hand their arguments straight to
that kernel's launcher, as Triton's own dispatch ends by doing. The signature is deliberately
wider than what Triton specialises on: every tensor's dtype and 16-byte alignment, every int's
width class, ``== 1`` and divisibility by 16, every keyword's value and type, and the current
device. So two launches share a compiled kernel here only where Triton would have given them
the same one.

Not taken (Triton's dispatch runs instead, exactly as before): Tritons without ``triton.knobs``
(before 3.4, whose launchers take another argument list), kernels made under the interpreter,
callable grids, argument types other than tensors, ints, floats, bools and None, tensor
keywords, and any launch while Triton's
launch hooks are set (profilers such as proton see every launch as usual). Triton's check that a
kernel's global constants have not changed since it was compiled is skipped on direct launches:
the pack's kernels read no mutable globals.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    from triton import knobs as _knobs
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except Exception:  # no Triton, or one before 3.4 (no knobs): Triton's dispatch only
    triton = None
    _knobs = None
    _Interpreted = None

# Bounded so that a caller feeding ever-new signatures cannot grow it without end; a decode
# meets a few dozen.
MAX_KERNELS = 4096


@dataclass
class LaunchSettings:
    """``direct``: launch compiled kernels directly (the default); off = Triton's dispatch on
    every call (``bench --triton-launch jit`` compares the two)."""

    direct: bool = True


launch_settings = LaunchSettings()


def direct_launch_unavailable_reason() -> str | None:
    if triton is None:
        return "Triton without triton.knobs (before 3.4), or no Triton"
    return None


class _Unkeyable(Exception):
    pass


_I32_BOUND = 2 ** 31
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def _arg_key(a: Any) -> Any:
    """What about one positional argument could make Triton pick another compiled kernel."""
    kind = type(a)
    if kind is int:  # Triton: i32 / i64 / u64 by range; ``== 1`` and ``% 16 == 0`` specialised
        if -_I32_BOUND <= a < _I32_BOUND:  # nearly every int: one small int as its key
            return 1 if a == 1 else 16 if a % 16 == 0 else 0
        return (a % 16 == 0, a >= 2 ** 63)
    if kind is float:
        return float
    if kind is bool:
        return (bool, a)
    if a is None:
        return None
    if isinstance(a, torch.Tensor):  # pointer: dtype and 16-byte alignment
        return (a.dtype, a.data_ptr() % 16 == 0)
    raise _Unkeyable


def launch_key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """The direct-launch cache key; raises ``_Unkeyable`` for an argument it cannot key (an
    odd keyword value raises ``TypeError`` when the key is hashed).

    Keywords are keyed by value: right for constexprs and options, and it keeps any runtime
    value passed by keyword correct too (its kept tail holds that value). A tensor keyword is
    refused: keyed by identity it would never hit, and the kept entry would hold the tensor."""
    # Values with their types: 1 == True == 1.0 as dict keys, but not as constexprs.
    types = tuple(map(type, kwargs.values()))
    if not _TENSOR_TYPES.isdisjoint(types):
        raise _Unkeyable
    return (kernel, device, tuple(map(_arg_key, args)), tuple(kwargs.items()), types)


class CompiledLaunch:
    """One compiled kernel and the arguments Triton's dispatch would add to a call's own: its
    launcher takes every parameter in signature order, constexprs included (Triton >= 3.4)."""

    __slots__ = ("run", "function", "packed", "launch_metadata", "tail", "stream_of")

    def __init__(self, compiled, tail: tuple, stream_of):
        self.run = compiled.run
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.launch_metadata = compiled.launch_metadata
        self.tail = tail
        self.stream_of = stream_of

    def __call__(self, grid: tuple, device: int, args: tuple) -> None:
        full = args + self.tail
        stream = self.stream_of(device)
        g = tuple(grid) + (1, 1)
        runtime = _knobs.runtime
        self.run(g[0], g[1], g[2], stream, self.function, self.packed,
                 self.launch_metadata(grid, stream, *full),
                 runtime.launch_enter_hook, runtime.launch_exit_hook, *full)


def signature_tail(kernel, args: tuple, kwargs: dict) -> tuple | None:
    """The values of the parameters after the positional ones, in signature order, from the
    keywords or the parameters' defaults; None where one is missing or a keyword is no
    parameter of the kernel's that the options (``num_warps``...) explain."""
    names = list(getattr(kernel, "arg_names", ()))
    if len(args) > len(names) or any(k in names[:len(args)] for k in kwargs):
        return None
    params = getattr(kernel, "params", None)
    tail = []
    for i in range(len(args), len(names)):
        name = names[i]
        if name in kwargs:
            tail.append(kwargs[name])
            continue
        default = params[i].default if params is not None else inspect.Parameter.empty
        if default is inspect.Parameter.empty:
            return None
        tail.append(default)
    return tuple(tail)


_KERNELS: dict[tuple, CompiledLaunch] = {}
_current_device = torch.cuda.current_device


def _stream_getter():
    # Resolved when a kernel is kept, not at import: the driver initialises CUDA.
    return triton.runtime.driver.active.get_current_stream


def _hook_active(hook) -> bool:
    # A plain callable (older knobs) or a HookChain (newer; set when it holds calls).
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = _knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def launch_direct(kernel, grid, args: tuple, kwargs: dict) -> bool:
    """Launch ``kernel[grid](*args, **kwargs)``, directly where a compiled kernel was kept for
    this signature; False (nothing launched) where the launch is not one to take here."""
    # The kernel's own type says whether it was made under the interpreter (no compiled kernel
    # to keep), without reading the environment on every launch.
    if (triton is None or not launch_settings.direct or not isinstance(grid, tuple)
            or isinstance(kernel, _Interpreted)):
        return False
    device = _current_device()
    try:
        key = launch_key(kernel, device, args, kwargs)
        entry = _KERNELS.get(key)
    except (_Unkeyable, TypeError):
        return False
    if entry is not None and not _hooks_set():
        entry(grid, device, args)
        return True
    compiled = kernel[grid](*args, **kwargs)
    if entry is None and compiled is not None and not _hooks_set():
        tail = signature_tail(kernel, args, kwargs)
        if tail is not None:
            if len(_KERNELS) >= MAX_KERNELS:
                _KERNELS.clear()
            _KERNELS[key] = CompiledLaunch(compiled, tail, _stream_getter())
    return True


def forget_compiled_launches() -> None:
    """Drop every kept kernel (tests; the next launch of each goes through Triton again)."""
    _KERNELS.clear()
