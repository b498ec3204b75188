"""ComfyUI's command-line switches the fast path honours, read from the running tree (absent
outside ComfyUI, or in a tree that lacks the switch)."""
from __future__ import annotations

import sys


def comfy_arg(name: str, default=None):
    args = getattr(sys.modules.get("comfy.cli_args"), "args", None)
    return getattr(args, name, default)


def cuda_graphs_disabled() -> bool:
    """``--disable-cuda-graphs``: the user asked ComfyUI to capture no CUDA graph."""
    return bool(comfy_arg("disable_cuda_graphs", False))
