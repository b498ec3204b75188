"""setuptools hook that finds the package list instead of writing it out.

Everything else is in pyproject.toml. The repository root is the package ComfyUI loads from
``custom_nodes/``; pyproject.toml maps it to the import name ``fast_vae_decode``
(``package-dir``), and its declarative ``packages.find`` cannot put that name in front of what
it finds. So the subpackages are found here: every folder under the code rooms (a new
``fastpath/families/<family>/`` needs no edit) and the data folders shipped as package data
(``web/``, ``example_workflows/``), which setuptools counts as namespace packages and warns
about when they are left out.
"""
from setuptools import find_namespace_packages, setup

NAME = "fast_vae_decode"
ROOMS = ("bench", "fastpath", "kernels", "nodes", "web", "example_workflows")


def packages() -> list[str]:
    found = find_namespace_packages(
        where=".", include=[*ROOMS, *(f"{room}.*" for room in ROOMS)],
        exclude=["*__pycache__*"])
    return [NAME, *(f"{NAME}.{name}" for name in sorted(found))]


if __name__ == "__main__":
    setup(packages=packages())
