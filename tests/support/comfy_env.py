"""Tier 2: a real ComfyUI tree, found through ``COMFYUI_PATH``.

ComfyUI is a source tree, not a package: it is put first on ``sys.path`` (before the repository
root, whose ``nodes/`` folder would otherwise shadow ComfyUI's ``nodes.py``) and its argument
parser is given a command line of our choosing. The pack is loaded through ComfyUI's own
custom-node loader from a ``custom_nodes`` folder that links to this checkout.
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import os
import pathlib
import sys
import tempfile

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
REPO = pathlib.Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "ComfyUI-Fast-VAE-Decode"

requires_comfyui = pytest.mark.skipif(
    not COMFYUI_PATH, reason="ComfyUI tier: set COMFYUI_PATH to a ComfyUI tree")


@functools.lru_cache(maxsize=None)
def comfy_nodes():
    """ComfyUI's ``nodes`` module, imported in-process once (``--cpu`` when there is no GPU)."""
    root = str(pathlib.Path(COMFYUI_PATH).resolve())
    sys.path.insert(0, root)
    shadow = sys.modules.get("nodes")
    if shadow is not None and not getattr(shadow, "__file__", "").startswith(root):
        del sys.modules["nodes"]
    argv = sys.argv
    sys.argv = ["main.py"] + ([] if torch.cuda.is_available() else ["--cpu"])
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.model_management  # noqa: F401  (parses the arguments)

        import nodes
    finally:
        sys.argv = argv
    return nodes


@functools.lru_cache(maxsize=None)
def custom_nodes_dir() -> pathlib.Path:
    """A custom_nodes folder holding only a link to this checkout, under the pack's real name."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="fvd-custom-nodes-"))
    (folder / PACK_DIR_NAME).symlink_to(REPO, target_is_directory=True)
    return folder


@functools.lru_cache(maxsize=None)
def loaded_pack() -> dict:
    """Load the pack with ComfyUI's loader; returns ComfyUI's ``NODE_CLASS_MAPPINGS``."""
    nodes = comfy_nodes()
    path = str(custom_nodes_dir() / PACK_DIR_NAME)
    ok = nodes.load_custom_node(path, module_parent="custom_nodes")
    if asyncio.iscoroutine(ok):
        ok = asyncio.run(ok)
    assert ok, "ComfyUI's custom-node loader refused the pack (see the log above)"
    # As conftest does for the test copy: the loaded copy's kernels are decorated now, under
    # this run's TRITON_INTERPRET, not inside a test that switched the interpreter off.
    root = str(custom_nodes_dir() / PACK_DIR_NAME).replace(".", "_x_")
    importlib.import_module(f"{root}.fastpath.families")
    return nodes.NODE_CLASS_MAPPINGS


def pack_module(name: str):
    """A submodule of the copy of the pack that ComfyUI's loader imported (its own registries)."""
    loaded_pack()
    # The loader registers a folder under its whole path, with "." spelled "_x_".
    root = str(custom_nodes_dir() / PACK_DIR_NAME).replace(".", "_x_")
    return sys.modules[f"{root}.{name}"]
