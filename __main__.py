"""``python -m fast_vae_decode <demo|bench>``: see ``bench/cli.py``.

Also runs as ``python <repo>`` or ``python <repo>/__main__.py``: the repository root is the
package, but under a directory name that is not its import name, so it is then imported
explicitly as ``fast_vae_decode`` (its modules use relative imports).
"""
import pathlib
import sys

_root = pathlib.Path(__file__).resolve().parent
# The root on sys.path (``python -m`` run from the checkout, or a run by path) lets its folders
# shadow installed packages: ``nodes/`` ComfyUI's ``nodes.py``, ``kernels/`` Hugging Face's
# ``kernels`` that newer transformers import (through diffusers, in every benchmark). The
# package never needs the root there: it is imported as ``fast_vae_decode``.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _root]

if __package__:
    from .bench.cli import main
else:  # run by path: no parent package
    import importlib.util

    if "fast_vae_decode" not in sys.modules:
        _spec = importlib.util.spec_from_file_location(
            "fast_vae_decode", _root / "__init__.py", submodule_search_locations=[str(_root)])
        _package = importlib.util.module_from_spec(_spec)
        sys.modules["fast_vae_decode"] = _package
        _spec.loader.exec_module(_package)
    from fast_vae_decode.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
