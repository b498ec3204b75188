"""Packaging facts the Registry, ComfyUI Manager and pip rely on."""
from __future__ import annotations

import pathlib
import re

import tomllib

import fast_vae_decode

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_one_version():
    assert PYPROJECT["project"]["version"] == fast_vae_decode.__version__


def test_registry_metadata():
    comfy = PYPROJECT["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon", "requires-comfyui"} <= comfy.keys()
    assert (REPO / comfy["Icon"]).is_file() or comfy["Icon"].startswith("https://")


def test_requirements_never_pull_torch():
    names = [re.split(r"[<>=!~;\[ ]", line.strip())[0].lower()
             for line in (REPO / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert not {"torch", "torchvision", "torchaudio", "triton"} & set(names)
    runtime = [re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in PYPROJECT["project"]["dependencies"]]
    assert "triton" not in runtime  # Triton is optional; Linux CUDA torch brings its own


def test_published_archive_keeps_tests_out():
    ignored = (REPO / ".comfyignore").read_text().split()
    assert "tests/" in ignored and "docs/" in ignored
    assert "example_workflows/" not in ignored


def test_package_imports_without_comfyui_or_diffusers():
    """Importing the package and its math layers pulls in neither ComfyUI nor diffusers."""
    import subprocess
    import sys

    script = (
        "import importlib.util, sys\n"
        f"root = {str(REPO)!r}\n"
        "spec = importlib.util.spec_from_file_location('fast_vae_decode', root + '/__init__.py',"
        " submodule_search_locations=[root])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['fast_vae_decode'] = m\n"
        "spec.loader.exec_module(m)\n"
        "import fast_vae_decode.fastpath.quality, fast_vae_decode.fastpath.install\n"
        "fast_vae_decode.fastpath.install.families()\n"
        "import fast_vae_decode.kernels.group_norm_silu, fast_vae_decode.kernels.rms_norm_silu\n"
        "print(sorted(n for n in ('comfy', 'comfy_api', 'diffusers', 'nodes') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert callable(fast_vae_decode.comfy_entrypoint)
    assert fast_vae_decode.WEB_DIRECTORY == "./web"
