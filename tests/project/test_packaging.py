"""Packaging facts the Registry, ComfyUI Manager and pip rely on."""
from __future__ import annotations

import pathlib
import re
import sys

import tomllib

import fast_vae_decode

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_one_version():
    assert PYPROJECT["project"]["version"] == fast_vae_decode.__version__


def test_registry_metadata():
    """The Comfy Registry's pyproject specification: Icon and Repository are URLs. Both
    addresses are unknown until the repository is public, so each field is either an https URL
    or left out (a TODO note in pyproject.toml), never a path or a placeholder."""
    comfy = PYPROJECT["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "requires-comfyui"} <= comfy.keys()
    if "Icon" in comfy:
        assert comfy["Icon"].startswith("https://"), comfy["Icon"]
    urls = PYPROJECT["project"].get("urls", {})
    if "Repository" in urls:
        assert urls["Repository"].startswith("https://"), urls["Repository"]
    text = (REPO / "pyproject.toml").read_text()
    for field in ("Icon", "Repository"):
        assert field in urls or field in comfy or f"TODO before publishing: {field}" in text \
            or f"TODO before publishing: [project.urls] {field}" in text, field


def test_license_is_an_spdx_expression_with_its_file():
    # setuptools >= 77 deprecates the {file=...} / {text=...} tables; comfy-cli reads a string.
    assert PYPROJECT["project"]["license"] == "MIT"
    assert all((REPO / f).is_file() for f in PYPROJECT["project"]["license-files"])


def _copy_of_the_package(destination: pathlib.Path) -> pathlib.Path:
    """The files a build sees, without tests, docs, VCS data or build leftovers."""
    import shutil

    skip = shutil.ignore_patterns(".git", "tests", "docs", "__pycache__", "build", "dist",
                                  "*.egg-info", ".comfyui", ".whl", ".venv", "out")
    return pathlib.Path(shutil.copytree(REPO, destination / "src", ignore=skip))


def test_built_wheel_has_every_subpackage_and_the_data_folders(tmp_path):
    """A wheel from the setuptools configuration: every .py under the code rooms (including
    subpackages added later), web/ and example_workflows/, and no 'absent from the packages
    configuration' warning."""
    import subprocess
    import sys
    import zipfile

    source = _copy_of_the_package(tmp_path)
    out = tmp_path / "wheel"
    # Built from the copy's folder (the backend builds the working directory), which ``-c``
    # also puts on sys.path: dropped, or its kernels/ would shadow an installed ``kernels``
    # whose setuptools plugin the build loads (Hugging Face's, with newer transformers).
    script = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
              "from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", script, str(out)], cwd=source,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "absent from the `packages` configuration" not in log, log[-3000:]
    wheel = out / result.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"fast_vae_decode/{path.relative_to(REPO).as_posix()}"
                for room in ("bench", "fastpath", "kernels", "nodes")
                for path in (REPO / room).rglob("*.py") if "__pycache__" not in path.parts}
    assert "fast_vae_decode/fastpath/families/kl/install.py" in expected
    assert expected <= names, sorted(expected - names)
    for data in ("web/*.js", "web/*.svg", "example_workflows/*.json",
                 "example_workflows/api/*.json"):
        files = [f"fast_vae_decode/{p.relative_to(REPO).as_posix()}" for p in REPO.glob(data)]
        assert files and set(files) <= names, data
    assert not any(n.startswith(("fast_vae_decode/tests/", "tests/")) for n in names)


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


def test_the_checkout_root_is_off_sys_path_in_the_tests():
    """``python -m pytest`` from the checkout puts its root on sys.path; the conftest takes it
    off, so ``import kernels`` (newer transformers, through diffusers) finds the installed
    package and ``import nodes`` ComfyUI's, never this repository's folders."""
    assert all(pathlib.Path(p or ".").resolve() != REPO for p in sys.path)
