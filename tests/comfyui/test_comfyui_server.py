"""Tier 2: a headless ComfyUI server (``main.py --cpu``) runs an API-format workflow that uses
FastVAEDecode and returns the image, as a service posting JSON to ``/prompt`` would."""
from __future__ import annotations

import json
import pathlib

import pytest

from support.comfy_env import PACK_DIR_NAME, comfy_nodes, requires_comfyui
from support.comfy_server import ComfyServer, add_vae_file

pytestmark = [requires_comfyui, pytest.mark.comfyui]

WORKFLOW = pathlib.Path(__file__).parents[1] / "support" / "workflows" / "fast_vae_decode_api.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy_nodes()
    srv = ComfyServer(tmp_path_factory.mktemp("comfy-base"))
    add_vae_file(srv, "fvd_test_sdxl.safetensors", seed=0)
    srv.start()
    yield srv
    srv.stop()


def test_api_workflow_returns_the_image(server):
    prompt = json.loads(WORKFLOW.read_text())
    entry = server.run_prompt(prompt)
    assert entry["status"]["status_str"] == "success", entry["status"]
    images = entry["outputs"]["4"]["images"]
    assert len(images) == 1
    path = server.base / "output" / images[0].get("subfolder", "") / images[0]["filename"]
    assert path.is_file() and path.stat().st_size > 0
    ui = entry["outputs"]["3"]
    assert ui["text"][0].startswith(("high", "fallback"))
    assert ui["fast_vae_decode"][0]["quality"] == "high"
    # ComfyUI logs its own optional modules it cannot import (torchaudio missing, say); only
    # a failure to import this pack matters here.
    assert not [line for line in server.log_text().splitlines()
                if "Cannot import" in line and PACK_DIR_NAME in line]


def test_object_info_lists_the_nodes(server):
    info = server.get("/object_info/FastVAEDecode")["FastVAEDecode"]
    assert info["display_name"] == "Fast VAE Decode (quality)"
    assert info["input"]["required"]["quality"][0] == ["high", "lossless"] or \
        info["input"]["required"]["quality"][1]["options"] == ["high", "lossless"]
