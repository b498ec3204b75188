"""Tier 2, in a real browser: the web extension (web/fast_vae_decode.js) inside ComfyUI's own
frontend, served by a headless ComfyUI server, driven through headless Chromium.

It checks what a user sees and what gets saved: the default-quality setting applies to new
nodes only (a loaded workflow keeps its saved quality), a node shows which path ran and its
time after a run, and the status never leaks into saved workflows or API prompts. Screenshots
go to ``$FVD_ARTIFACTS`` (else a pytest temp folder).

The frontend is whatever the ComfyUI tree's Python environment has installed; to see 0.3.64 with
the frontend it pins (1.27.x), put that package first on ``PYTHONPATH``.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import re
import time
import urllib.request
import warnings

import pytest

from support.cdp_browser import Browser, find_chromium
from support.comfy_env import COMFYUI_PATH, comfy_nodes, requires_comfyui
from support.comfy_server import ComfyServer, add_vae_file
from support.comfy_workflows import without_meta

pytestmark = [
    requires_comfyui,
    pytest.mark.skipif(find_chromium() is None,
                       reason="browser tier: no Chromium binary (apt-get install chromium)"),
    pytest.mark.comfyui,
]

REPO = pathlib.Path(__file__).resolve().parents[2]
UI_WORKFLOW = REPO / "tests" / "support" / "workflows" / "fast_vae_decode_ui.json"
EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
APP = "window.comfyAPI.app.app"
SETTING = "FastVAEDecode.DefaultQuality"
STATUS = "fast_vae_decode_status"
LATENT_NODE, HIGH_NODE, LOSSLESS_NODE = 2, 3, 4  # node ids in UI_WORKFLOW

MS = r"\d+(\.\d)? ms"
HIGH = re.compile(rf"^high · {MS} · \d+ fused$")
FALLBACK = re.compile(rf"^fallback: .+ · {MS}$")  # CPU, no Triton, offload...: stock path, why
LOSSLESS = re.compile(rf"^lossless · {MS}$")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy_nodes()
    srv = ComfyServer(tmp_path_factory.mktemp("comfy-web"))
    add_vae_file(srv, "fvd_test_sdxl.safetensors", seed=0)
    srv.start()
    # A first visit opens the template browser over the canvas; a returning user's does not.
    # The minimap would cover part of the graph in screenshots.
    _post(srv, "/settings", {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False})
    yield srv
    srv.stop()


def _post(srv: ComfyServer, path: str, payload: dict) -> None:
    req = urllib.request.Request(srv.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


@pytest.fixture(scope="module")
def page(server):
    browser = Browser(find_chromium()).start()
    try:
        browser.goto(server.url)
        browser.wait_for(
            f"{APP}?.graph && window.LiteGraph?.registered_node_types?.FastVAEDecode && "
            f"{APP}.extensionManager?.setting?.get('{SETTING}') !== undefined", timeout=120)
        yield browser
        # The extension's own warnings say "[Fast VAE Decode]"; errors in it name its file.
        errors = [line for line in browser.console if "[Fast VAE Decode]" in line or
                  (line.startswith(("exception", "error")) and "fast_vae_decode" in line)]
        assert not errors, "\n".join(errors)
    finally:
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> pathlib.Path:
    folder = os.environ.get("FVD_ARTIFACTS")
    path = pathlib.Path(folder) if folder else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def set_default_quality(page: Browser, quality: str) -> None:
    page.evaluate(f"Promise.resolve({APP}.extensionManager.setting.set('{SETTING}', "
                  f"'{quality}')).then(() => true)")


def load_workflow(page: Browser, workflow: dict) -> None:
    page.evaluate(f"Promise.resolve({APP}.loadGraphData({json.dumps(workflow)})).then(() => true)")


def quality_of(page: Browser, node_id: int) -> str:
    return page.evaluate(
        f"{APP}.graph.getNodeById({node_id}).widgets.find(w => w.name === 'quality').value")


# {node id: shown status} once both decode nodes show one, else null.
STATUSES_JS = f"""(() => {{
    const out = {{}};
    for (const id of [{HIGH_NODE}, {LOSSLESS_NODE}]) {{
        const w = {APP}.graph.getNodeById(id)?.widgets?.find(w => w.name === '{STATUS}');
        if (!w?.value) return null;
        out[id] = w.value;
    }}
    return out;
}})()"""


_runs = itertools.count()


def run_from_page(page: Browser, server: ComfyServer, timeout: float = 180.0) -> dict:
    """Queue the loaded graph as the Run button does; wait for the statuses and an idle queue.

    ComfyUI sends no output for nodes it serves from its cache, so each run asks for a latent
    of a size no earlier run used: every run decodes again."""
    width = 64 + 8 * next(_runs)
    page.evaluate(f"{APP}.graph.getNodeById({LATENT_NODE}).widgets"
                  f".find(w => w.name === 'width').value = {width}")
    page.evaluate(f"Promise.resolve({APP}.queuePrompt(0, 1)).then(() => true)")
    shown = page.wait_for(STATUSES_JS, timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = server.get("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            return {int(k): v for k, v in shown.items()}
        time.sleep(0.25)
    raise TimeoutError("the queue did not drain")


def test_the_setting_is_registered_with_high_as_default(page):
    assert page.evaluate(f"{APP}.extensionManager.setting.get('{SETTING}')") == "high"


def test_new_nodes_take_the_default_quality(page):
    new_node_quality = ("LiteGraph.createNode('FastVAEDecode').widgets"
                        ".find(w => w.name === 'quality').value")
    for quality in ("lossless", "high"):
        set_default_quality(page, quality)
        assert page.evaluate(new_node_quality) == quality


def test_loaded_workflows_keep_their_saved_quality(page):
    set_default_quality(page, "lossless")
    try:
        load_workflow(page, json.loads(UI_WORKFLOW.read_text()))
        assert quality_of(page, HIGH_NODE) == "high"
        assert quality_of(page, LOSSLESS_NODE) == "lossless"
        # Copy and paste and Clone go through the same create-then-configure path.
        assert page.evaluate(f"{APP}.graph.getNodeById({HIGH_NODE}).clone().widgets"
                             ".find(w => w.name === 'quality').value") == "high"
    finally:
        set_default_quality(page, "high")


def test_the_node_shows_its_path_and_time_after_a_run(page, server, artifacts):
    load_workflow(page, json.loads(UI_WORKFLOW.read_text()))
    shown = run_from_page(page, server)
    assert HIGH.match(shown[HIGH_NODE]) or FALLBACK.match(shown[HIGH_NODE]), shown
    assert LOSSLESS.match(shown[LOSSLESS_NODE]), shown
    version = page.evaluate("window.__COMFYUI_FRONTEND_VERSION__") or "unknown"
    path = screenshot_of_graph(page, artifacts / f"fast_vae_decode_node_frontend-{version}.png")
    print(f"frontend {version}: {shown}; screenshot {path}")
    warn_if_not_the_pinned_frontend(version)


def test_the_status_is_never_saved_or_sent(page, server):
    load_workflow(page, json.loads(UI_WORKFLOW.read_text()))
    run_from_page(page, server)
    saved = page.evaluate(f"{APP}.graph.serialize().nodes.filter(n => n.type === 'FastVAEDecode')"
                          ".map(n => [n.id, n.widgets_values])")
    assert sorted(map(tuple, [(i, tuple(v)) for i, v in saved])) == \
        [(HIGH_NODE, ("high",)), (LOSSLESS_NODE, ("lossless",))]
    prompt = page.evaluate(f"{APP}.graphToPrompt().then(p => p.output)")
    assert set(prompt[str(HIGH_NODE)]["inputs"]) == {"samples", "vae", "quality"}


def test_the_status_comes_back_when_switching_back_to_the_workflow(page, server):
    """Switching tabs rebuilds the graph's nodes; the frontend then hands over the outputs it
    kept (onNodeOutputsUpdated), not another onExecuted."""
    load_workflow(page, json.loads(UI_WORKFLOW.read_text()))
    shown = run_from_page(page, server)
    execute = f"{APP}.extensionManager.command.execute"
    page.evaluate(f"Promise.resolve({execute}('Comfy.NewBlankWorkflow')).then(() => true)")
    page.wait_for(f"{APP}.graph.nodes.length === 0", timeout=30)
    page.evaluate(f"Promise.resolve({execute}('Workspace.PreviousOpenedWorkflow')).then(() => true)")
    restored = page.wait_for(STATUSES_JS, timeout=30)
    assert {int(k): v for k, v in restored.items()} == shown


def test_vue_nodes_show_the_status_too(page, server, artifacts):
    """Frontends that offer Vue nodes ("Nodes 2.0", a user setting since 1.3x; 1.27 has only a
    hidden experiment) render custom widgets through a canvas fallback, which sets
    ``triggerDraw`` on the widget when it mounts it."""
    vue_setting_type = page.evaluate(
        f"({APP}.extensionManager.setting.settings ?? {{}})['Comfy.VueNodes.Enabled']?.type ?? null")
    if vue_setting_type in (None, "hidden"):
        pytest.skip("this frontend offers no Vue nodes to its users")
    page.evaluate(f"Promise.resolve({APP}.extensionManager.setting.set("
                  "'Comfy.VueNodes.Enabled', true)).then(() => true)")
    try:
        load_workflow(page, json.loads(UI_WORKFLOW.read_text()))
        shown = run_from_page(page, server)
        assert LOSSLESS.match(shown[LOSSLESS_NODE]), shown
        page.wait_for(f"typeof {APP}.graph.getNodeById({LOSSLESS_NODE}).widgets"
                      f".find(w => w.name === '{STATUS}').triggerDraw === 'function'", timeout=30)
        version = page.evaluate("window.__COMFYUI_FRONTEND_VERSION__") or "unknown"
        screenshot_of_graph(page, artifacts / f"fast_vae_decode_node_frontend-{version}-vue.png")
    finally:
        page.evaluate(f"Promise.resolve({APP}.extensionManager.setting.set("
                      "'Comfy.VueNodes.Enabled', false)).then(() => true)")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_load_and_queue_as_their_api_twins(page, example):
    """What the frontend would post to /prompt for a template is exactly its API-format twin."""
    load_workflow(page, json.loads(example.read_text()))
    unknown = page.evaluate(f"{APP}.graph.nodes.map(n => n.type)"
                            ".filter(t => !LiteGraph.registered_node_types[t])")
    assert unknown == []
    prompt = page.evaluate(f"{APP}.graphToPrompt().then(p => p.output)")
    twin = json.loads((example.parent / "api" / f"{example.stem}.api.json").read_text())
    assert without_meta(prompt) == twin


def screenshot_of_graph(page: Browser, path: pathlib.Path, scale: float = 1.0) -> pathlib.Path:
    """The part of the page that shows the loaded graph's nodes, with a margin."""
    time.sleep(0.5)  # let the canvas draw the last output (frames are not observable here)
    box = page.evaluate(f"""(() => {{
        const app = {APP};
        let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
        const add = (ax, ay, bx, by) => {{
            x0 = Math.min(x0, ax); y0 = Math.min(y0, ay);
            x1 = Math.max(x1, bx); y1 = Math.max(y1, by);
        }};
        const vueNodes = document.querySelectorAll('[data-node-id]');
        if (vueNodes.length) {{  // Vue nodes lay themselves out in the DOM
            for (const el of vueNodes) {{
                const r = el.getBoundingClientRect();
                add(r.left, r.top, r.right, r.bottom);
            }}
        }} else {{
            const ds = app.canvas.ds, rect = app.canvas.canvas.getBoundingClientRect();
            const title = LiteGraph.NODE_TITLE_HEIGHT ?? 30;
            for (const n of app.graph.nodes) {{
                const [ax, ay] = ds.convertOffsetToCanvas([n.pos[0], n.pos[1] - title]);
                const [bx, by] = ds.convertOffsetToCanvas([n.pos[0] + n.size[0], n.pos[1] + n.size[1]]);
                add(rect.left + ax, rect.top + ay, rect.left + bx, rect.top + by);
            }}
        }}
        const m = 16, top = 32;  // node badges sit above the title bar
        const x = Math.max(0, x0 - m), y = Math.max(0, y0 - top);
        return {{x, y, width: Math.min(innerWidth, x1 + m) - x,
                 height: Math.min(innerHeight, y1 + m) - y}};
    }})()""")
    return page.screenshot(path, clip=box, scale=scale)


def warn_if_not_the_pinned_frontend(version: str) -> None:
    requirements = pathlib.Path(COMFYUI_PATH) / "requirements.txt"
    pin = re.search(r"comfyui-frontend-package==([\w.]+)", requirements.read_text()) \
        if requirements.exists() else None
    if pin and pin.group(1) != version:
        warnings.warn(f"ComfyUI at {COMFYUI_PATH} pins frontend {pin.group(1)} but served "
                      f"{version}; put the pinned comfyui-frontend-package first on PYTHONPATH "
                      "to test the frontend its users get", stacklevel=2)
