"""Load a ComfyUI source tree into this process, the way ComfyUI's own tests do.

ComfyUI is not a package: it is a source tree the user points at (``--comfyui PATH`` or the
``COMFYUI_PATH`` environment variable). Nothing here runs at import time, so the bench imports
without ComfyUI.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import sys
import types

import torch

ENV_VAR = "COMFYUI_PATH"


def comfyui_path(explicit: str | None = None) -> pathlib.Path | None:
    """The ComfyUI tree to use: the explicit path, else ``$COMFYUI_PATH``, else none."""
    raw = explicit or os.environ.get(ENV_VAR) or None
    if raw is None:
        return None
    path = pathlib.Path(raw).expanduser().resolve()
    if not (path / "nodes.py").is_file() or not (path / "comfy").is_dir():
        raise FileNotFoundError(f"{path} is not a ComfyUI tree (expected a folder holding "
                                "nodes.py and comfy/)")
    return path


def setup_comfyui(path: pathlib.Path,
                  extra_args: list[str] | tuple[str, ...] = ()) -> types.ModuleType:
    """Import ComfyUI from ``path`` in-process, initialised as its ``main.py`` does; returns
    its ``nodes`` module.

    ``main.py`` is imported as a module (its server starts only under ``__main__``) with
    ``sys.argv`` swapped for that import: it parses the flags and sets up what a user's ComfyUI
    has, e.g. in newer trees dynamic VRAM (``comfy_aimdo`` initialised and
    ``CoreModelPatcher = ModelPatcherDynamic``), which is what the benchmark must measure.
    ``--cpu`` is added without CUDA; ``extra_args`` are more of ComfyUI's flags (e.g.
    ``--disable-dynamic-vram``). The tree goes first on ``sys.path``: this repository also has a
    ``nodes`` package, and a top-level ``import nodes`` must find ComfyUI's ``nodes.py``.
    """
    already = sys.modules.get("comfy")
    if already is not None:  # ``comfy`` is a namespace package: no __file__, only __path__
        loaded = {pathlib.Path(p).resolve().parent for p in getattr(already, "__path__", ())}
        if path not in loaded:
            raise RuntimeError(f"ComfyUI is already imported from {sorted(map(str, loaded))}, "
                               f"not {path}")
        if "comfy.model_management" in sys.modules and "nodes" in sys.modules and \
                str(getattr(sys.modules["nodes"], "__file__", "")).startswith(str(path)):
            # Already initialised in this process (by its main.py or a test harness): its
            # flags were parsed then, so it is used as it is.
            return sys.modules["nodes"]
    entry = str(path)
    for name in ("nodes", "main", "utils"):  # this repository's or another tree's modules
        shadow = sys.modules.get(name)
        if shadow is not None and not str(getattr(shadow, "__file__", None) or "/").startswith(entry):
            del sys.modules[name]
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    saved_argv = sys.argv
    sys.argv = ["main.py"] + ([] if torch.cuda.is_available() else ["--cpu"]) + list(extra_args)
    try:
        importlib.import_module("main")
        import comfy.sd  # noqa: F401

        import nodes
    finally:
        sys.argv = saved_argv
    # ComfyUI's start-up loads custom nodes, and the pack's entry point then starts Triton's
    # set-up; the bench imports the pack directly, so it does the same at the same moment.
    from ..nodes.extension import start_background_setup

    start_background_setup()
    return nodes


def memory_mode() -> str:
    """How the imported ComfyUI loads models: "dynamic VRAM" or its legacy patcher's mode."""
    import comfy.model_management as mm
    import comfy.model_patcher as mp

    dynamic = getattr(mp, "ModelPatcherDynamic", None)
    if dynamic is not None and getattr(mp, "CoreModelPatcher", None) is dynamic:
        return "dynamic VRAM"
    return f"legacy ({getattr(mm.vram_state, 'name', mm.vram_state)})"


def comfyui_version(path: pathlib.Path) -> str:
    """The tree's version string (``comfyui_version.py``), or "unknown"."""
    try:
        text = (path / "comfyui_version.py").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.strip().startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"
