"""Tier 2: the workflows in example_workflows/ (ComfyUI's template browser lists them) are valid
for the running server: every node exists, every input name exists, combo values are among
the server's options (model file names excepted: they are the user's), numbers are in range,
links join outputs and inputs of matching types, and each UI-format workflow maps to exactly
its API-format twin in example_workflows/api/. Nothing is executed: there are no model files.
(The checks of the files alone are tier 1, in tests/project/test_example_workflow_files.py.)

test_web_extension.py also loads each example in the real frontend and compares what it would
post to /prompt with the twin.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from support.comfy_env import PACK_DIR_NAME, comfy_nodes, requires_comfyui
from support.comfy_server import ComfyServer
from support.comfy_workflows import check_api_prompt, check_ui_workflow, ui_to_api
from support.example_workflows import EXAMPLES, EXAMPLES_DIR, twin_of


def tier2(test):
    """Needs a ComfyUI server (the checks of the files alone are tier 1, elsewhere)."""
    return requires_comfyui(pytest.mark.comfyui(test))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy_nodes()
    srv = ComfyServer(tmp_path_factory.mktemp("comfy-examples")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server) -> dict:
    return server.get("/object_info")


@tier2
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_ui_workflow_is_valid_for_the_server(example, object_info):
    assert check_ui_workflow(json.loads(example.read_text()), object_info) == []


@tier2
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_api_twin_is_valid_for_the_server(example, object_info):
    assert check_api_prompt(json.loads(twin_of(example).read_text()), object_info) == []


@tier2
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_ui_workflow_maps_to_its_api_twin(example, object_info):
    ui = json.loads(example.read_text())
    assert ui_to_api(ui, object_info) == json.loads(twin_of(example).read_text())


@tier2
def test_the_template_browser_lists_the_ui_workflows_only(server):
    listed = server.get("/workflow_templates").get(PACK_DIR_NAME, [])
    assert sorted(listed) == sorted(e.stem for e in EXAMPLES)
    for example in EXAMPLES:
        url = f"{server.url}/api/workflow_templates/{PACK_DIR_NAME}/{example.name}"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert json.loads(r.read()) == json.loads(example.read_text())


@tier2
def test_the_checks_catch_broken_workflows(object_info):
    """The validators are only worth something if they fail on the mistakes they look for."""
    example = json.loads((EXAMPLES_DIR / "sdxl_fast_vae_decode.json").read_text())
    twin = json.loads(twin_of(EXAMPLES_DIR / "sdxl_fast_vae_decode.json").read_text())
    decode = next(k for k, v in twin.items() if v["class_type"] == "FastVAEDecode")

    bad = json.loads(json.dumps(twin))
    bad[decode]["inputs"]["quality"] = "medium"
    bad[decode]["inputs"]["samples"][1] = 5
    bad[decode]["class_type"] = "FastVAEDecode"
    bad["99"] = {"class_type": "NoSuchNode", "inputs": {}}
    problems = " | ".join(check_api_prompt(bad, object_info))
    assert "'medium'" in problems and "NoSuchNode" in problems and "output 5" in problems

    bad = json.loads(json.dumps(example))
    node = next(n for n in bad["nodes"] if n["type"] == "FastVAEDecode")
    node["widgets_values"] = ["high", "extra"]
    bad["links"][0][5] = "IMAGE"
    problems = " | ".join(check_ui_workflow(bad, object_info))
    assert "more than the node has widgets" in problems and "carries IMAGE" in problems
