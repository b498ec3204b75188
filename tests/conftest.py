"""Test set-up shared by the three tiers.

- Tier 1 (default, CI): CPU only. Triton kernels run under ``TRITON_INTERPRET=1``; it has to be
  set before any ``@triton.jit`` decorator runs, so it is set here, before the package imports.
- Tier 2: ``COMFYUI_PATH`` points at a ComfyUI tree (see ``support/comfy_env.py``).
- Tier 3: the ``cuda`` marker; skipped without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
# ``python -m pytest`` from the checkout puts its root on sys.path, where its folders shadow
# installed packages (``kernels/`` Hugging Face's ``kernels``, which newer transformers import
# through diffusers; ``nodes/`` ComfyUI's ``nodes.py``). The package is imported by its name.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != REPO]
# The tests' helper package ``support`` (tests/support/) is imported from here.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
PACKAGE = "fast_vae_decode"


def _import_repo_as_package() -> None:
    """Make ``import fast_vae_decode`` work from a plain checkout (no ``pip install -e``).

    The repository root is the package (ComfyUI loads it from ``custom_nodes/``), so its
    directory name is not its import name; map it explicitly.
    """
    if PACKAGE in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and pathlib.Path(spec.origin).resolve().parent == REPO:
        return
    spec = importlib.util.spec_from_file_location(
        PACKAGE, REPO / "__init__.py", submodule_search_locations=[str(REPO)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)


_import_repo_as_package()
# Triton fixes interpreted-or-compiled when a kernel is decorated, i.e. at import. Load every
# kernel now, while TRITON_INTERPRET is what this run set: a test that turns the interpreter
# off (``no_interpreter``) must not be the first to import them.
importlib.import_module(f"{PACKAGE}.fastpath.families")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tier 3); skipped without one")
    config.addinivalue_line("markers", "comfyui: needs a ComfyUI tree in COMFYUI_PATH (tier 2)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tier 3)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def pack():
    """Tier 2: ComfyUI's NODE_CLASS_MAPPINGS after its own loader loaded this pack."""
    from support.comfy_env import loaded_pack

    return loaded_pack()


@pytest.fixture
def no_interpreter(monkeypatch):
    """Keep CPU decodes on the stock path, as a CPU user gets them: under the interpreter
    ``high`` would run the Triton kernels in numpy (slowly)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
