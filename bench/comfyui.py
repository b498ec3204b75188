"""Load a ComfyUI source tree into this process, the way ComfyUI's own tests do.

ComfyUI is not a package: it is a source tree the user points at (``--comfyui PATH`` or the
``COMFYUI_PATH`` environment variable). Nothing here runs at import time, so the bench imports
without ComfyUI.
"""
from __future__ import annotations

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
    """Import ComfyUI from ``path`` in-process and return its ``nodes`` module.

    ComfyUI parses its command line when ``comfy.cli_args`` is first imported, so ``sys.argv`` is
    swapped for that import only (``--cpu`` without CUDA, else ComfyUI would ask for a GPU;
    ``extra_args`` are more of ComfyUI's flags, e.g. ``--bf16-vae``). The
    tree goes first on ``sys.path``: this repository also has a ``nodes`` package, and a
    top-level ``import nodes`` must find ComfyUI's ``nodes.py``.
    """
    already = sys.modules.get("comfy")
    if already is not None:  # ``comfy`` is a namespace package: no __file__, only __path__
        loaded = {pathlib.Path(p).resolve().parent for p in getattr(already, "__path__", ())}
        if path not in loaded:
            raise RuntimeError(f"ComfyUI is already imported from {sorted(map(str, loaded))}, "
                               f"not {path}")
    entry = str(path)
    shadow = sys.modules.get("nodes")  # e.g. this repository's nodes/ imported as top level
    if shadow is not None and pathlib.Path(getattr(shadow, "__file__", None) or "/").parent != path:
        del sys.modules["nodes"]
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    saved_argv = sys.argv
    sys.argv = ["main.py"] + ([] if torch.cuda.is_available() else ["--cpu"]) + list(extra_args)
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.model_management  # noqa: F401  (parses the arguments above)
        import comfy.sd  # noqa: F401

        import nodes
    finally:
        sys.argv = saved_argv
    return nodes


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
