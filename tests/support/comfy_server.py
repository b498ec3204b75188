"""A headless ComfyUI server for tier-2 tests: its own base directory, our pack linked in."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from support.comfy_env import COMFYUI_PATH, PACK_DIR_NAME, REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, base: pathlib.Path):
        self.base = base
        (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
        link = base / "custom_nodes" / PACK_DIR_NAME
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        for sub in ("models/vae", "input", "output", "temp", "user"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = base / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0, env: dict | None = None) -> "ComfyServer":
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1",
               "--port", str(self.port), "--base-directory", str(self.base),
               "--disable-auto-launch", "--database-url", "sqlite:///:memory:"]
        self.proc = subprocess.Popen(cmd, cwd=COMFYUI_PATH, env=env, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited early:\n{self.log_text()[-4000:]}")
            try:
                self.get("/system_stats")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1.0)
        raise TimeoutError(f"ComfyUI did not start in {timeout:.0f}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read().decode()[:2000]}") from e

    def run_prompt(self, prompt: dict, timeout: float = 300.0) -> dict:
        """Queue an API-format prompt and wait for its history entry."""
        prompt_id = self.post("/prompt", {"prompt": prompt})["prompt_id"]
        return self.wait(prompt_id, timeout)

    def wait(self, prompt_id: str, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") != "error" or entry.get("outputs"):
                    return entry
                raise AssertionError(f"prompt failed: {entry['status']}\n{self.log_text()[-4000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"prompt {prompt_id} did not finish:\n{self.log_text()[-4000:]}")


def add_vae_file(server: ComfyServer, name: str, seed: int = 0):
    """Write a seeded full-size SDXL VAE to the server's models/vae (ComfyUI's VAELoader only
    builds full-width configurations); returns the VAE that loader builds from the file."""
    import comfy.sd
    from safetensors.torch import load_file, save_file

    from fast_vae_decode.bench.models import comfy_vae

    path = server.base / "models" / "vae" / name
    model = comfy_vae("sdxl", seed=seed).first_stage_model
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return comfy.sd.VAE(sd=load_file(str(path)))


def saved_png(server: ComfyServer, entry: dict, node: str):
    """The first image a SaveImage node of a finished prompt wrote, as a uint8 array."""
    import numpy as np
    from PIL import Image

    image = entry["outputs"][node]["images"][0]
    return np.asarray(Image.open(server.base / "output" / image["subfolder"] / image["filename"]))


def as_saved(images):
    """What SaveImage writes for the first of decoded ``images``: 8-bit, clipped."""
    import numpy as np

    return np.clip(255.0 * images[0].cpu().numpy(), 0, 255).astype(np.uint8)
