"""The workflows in example_workflows/ (ComfyUI's template browser lists them), as files.

Tier 1: each UI-format workflow has its API-format twin in example_workflows/api/ (and no twin
is orphaned), and each uses the pack's node. (Their validity for a running ComfyUI server is
tier 2, in tests/comfyui/test_example_workflows.py.)
"""
from __future__ import annotations

import json

from support.example_workflows import API_TWINS, EXAMPLES, twin_of


def test_every_example_has_an_api_twin_and_no_twin_is_orphaned():
    assert EXAMPLES, "example_workflows/ is empty"
    assert sorted(twin_of(e) for e in EXAMPLES) == API_TWINS


def test_examples_use_the_pack_nodes():
    for example in EXAMPLES:
        types = {n["type"] for n in json.loads(example.read_text())["nodes"]}
        assert "FastVAEDecode" in types, example.name
