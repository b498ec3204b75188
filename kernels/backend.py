"""Whether Triton can run a kernel on a given tensor, and why not when it cannot.

The reason is recorded once (at import) so the UI and the log can show it; kernels ask
``triton_unavailable_reason(tensor)`` per call because a CPU tensor, or a tensor on a device
Triton was not built for, is a per-call question.
"""
from __future__ import annotations

import os

import torch

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
