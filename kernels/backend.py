"""Whether Triton can run a kernel on a given tensor, and why not when it cannot.

The reason is recorded once (at import) so the UI and the log can show it; kernels ask
``triton_unavailable_reason(tensor)`` per call because a CPU tensor, or a tensor on a device
Triton was not built for, is a per-call question.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

from .direct_launch import launch_direct

try:  # Triton is optional: Windows without triton-windows, macOS and CPU-only installs lack it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install raising anything at import
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = f"no Triton ({type(exc).__name__}: {exc})".splitlines()[0][:160]


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(x: torch.Tensor | None = None) -> str | None:
    """None when a Triton kernel may run on ``x``; otherwise a short reason for the UI and log."""
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    if x is None:
        return None if (interpreting() or torch.cuda.is_available()) else "no CUDA device"
    if x.device.type == "cuda":
        return None
    if x.device.type == "cpu" and interpreting():
        return None
    return f"{x.device.type} tensor"


def on_device(device: torch.device):
    """``device`` as the current CUDA device around launches (Triton launches on the current
    one, and a tensor may live on another GPU); a no-op when it already is, or off CUDA."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# --- Triton's driver and its compiler's cache key, set up once ahead of the warm-up -------------

# Two one-time costs every first compile waits on, both mostly outside the GIL, so one thread
# of their own takes them while the model loads and the warm-up's first modules record:
# - Triton's driver: its first use builds and loads a C helper module (gcc; 0.3-0.9 s on the
#   H200 host with an empty Triton cache: the warm-up's timeline had it before any module).
# - The compiler's cache key (``triton_key``: SHA-256 of Triton's Python files and of
#   libtriton, ~500 MB). Cached per process but not locked: compile threads starting together
#   each hashed the library in full (on the H200 host 16 of them sat in it at once).
_COMPILER_KEY: dict[str, threading.Thread] = {}
_COMPILER_KEY_LOCK = threading.Lock()


def _set_up_driver() -> None:
    try:
        triton.runtime.driver.active.get_current_device()
    except Exception:  # best effort: the first launch sets it up (or fails) as without this
        pass


def _hash_compiler() -> None:
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # best effort: a Triton without it hashes (or not) its own way
        pass


def _set_up_compiler() -> None:
    _set_up_driver()
    _hash_compiler()


def start_compiler_key() -> None:
    """Start setting up Triton's driver and hashing its compiler's cache key in the
    background, once per process (a no-op without Triton or under the interpreter, which
    compiles nothing). Call it only where a GPU is there to compile for."""
    if triton is None or interpreting():
        return
    with _COMPILER_KEY_LOCK:
        if "thread" not in _COMPILER_KEY:
            thread = threading.Thread(target=_set_up_compiler, name="fvd-compiler-key",
                                      daemon=True)
            _COMPILER_KEY["thread"] = thread
            thread.start()


def wait_compiler_key() -> None:
    """Make sure the driver is set up and the key hashed (started here if it was not): every
    compile waits on this first, so no two threads set the driver up or hash at once."""
    start_compiler_key()
    thread = _COMPILER_KEY.get("thread")
    if thread is not None:
        thread.join()


# --- launches, or compile-only recording (first-decode warm-up) --------------------------------

_RECORDING = threading.local()


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, unless this thread is recording launches (see
    ``recording_launches``): then the launch is only noted, to be compiled later. Kernels met
    before go to their compiled launcher directly (``direct_launch``)."""
    recorded = getattr(_RECORDING, "launches", None)
    if recorded is not None:
        recorded.append((kernel, grid, args, kwargs))
    elif not launch_direct(kernel, grid, args, kwargs):
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def recording_launches() -> Iterator[list]:
    """Inside: Triton launches made through ``launch`` on this thread run nothing and are
    collected instead (outputs stay uninitialised). Used to learn which kernel variants a fast
    path needs, so they can be compiled in parallel (``compile_launch``)."""
    previous = getattr(_RECORDING, "launches", None)
    _RECORDING.launches = recorded = []
    try:
        yield recorded
    finally:
        _RECORDING.launches = previous


def _unspecialized(kernel) -> frozenset:
    """The names of ``kernel``'s parameters that Triton does not specialize on
    (``do_not_specialize``), from the JIT function or, under the interpreter, its options."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ()
    arg_names = list(getattr(kernel, "arg_names", ()))
    return frozenset(arg_names[n] if isinstance(n, int) and n < len(arg_names) else n
                     for n in names)


def _arg_class(a, specialized: bool):
    if isinstance(a, torch.Tensor):
        return str(a.dtype)
    if specialized and type(a) is int:  # Triton: ``== 1`` and ``% 16 == 0`` are compile-time
        return ("int", a == 1, a % 16 == 0)
    return type(a).__name__


def variant_key(launch_record) -> tuple:
    """What makes Triton compile a separate variant: the kernel, constexpr/option keywords,
    the dtypes of the tensor arguments, and the ``== 1`` / ``% 16`` class of each int it
    specializes on (sizes and flags are in the pack's ``do_not_specialize`` lists, so a value
    change there is no new variant)."""
    kernel, _, args, kwargs = launch_record
    free = _unspecialized(kernel)
    names = list(getattr(kernel, "arg_names", ()))
    classes = tuple(_arg_class(a, i >= len(names) or names[i] not in free)
                    for i, a in enumerate(args))
    return (kernel, classes, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


def compile_launch(launch_record) -> None:
    """Compile (and load, with its launcher) the variant a recorded launch would use."""
    kernel, grid, args, kwargs = launch_record
    if interpreting():
        return  # the interpreter compiles nothing
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    init = getattr(compiled, "_init_handles", None)  # launcher build + module load
    if callable(init):
        init()
