"""``python -m fast_vae_decode <demo|bench>``: see ``bench/cli.py``.

Also runs as ``python <repo>`` or ``python <repo>/__main__.py``: the repository root is the
package, but under a directory name that is not its import name, so it is then imported
explicitly as ``fast_vae_decode`` (its modules use relative imports).
"""
import sys

if __package__:
    from .bench.cli import main
else:  # run by path: no parent package
    import importlib.util
    import pathlib

    _root = pathlib.Path(__file__).resolve().parent
    if "fast_vae_decode" not in sys.modules:
        _spec = importlib.util.spec_from_file_location(
            "fast_vae_decode", _root / "__init__.py", submodule_search_locations=[str(_root)])
        _package = importlib.util.module_from_spec(_spec)
        sys.modules["fast_vae_decode"] = _package
        _spec.loader.exec_module(_package)
    # The root on sys.path would let a top-level ``import nodes`` find this repo's ``nodes/``
    # instead of ComfyUI's ``nodes.py``; the package does not need it there.
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _root]
    from fast_vae_decode.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
