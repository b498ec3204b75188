"""The workflows in example_workflows/ and their API-format twins in example_workflows/api/,
shared by tests/project/test_example_workflow_files.py (tier 1) and
tests/comfyui/test_example_workflows.py (tier 2)."""
from __future__ import annotations

import pathlib

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parents[2] / "example_workflows"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.json"))
API_TWINS = sorted((EXAMPLES_DIR / "api").glob("*.api.json"))


def twin_of(example: pathlib.Path) -> pathlib.Path:
    return EXAMPLES_DIR / "api" / f"{example.stem}.api.json"
