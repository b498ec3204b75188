"""Headless Chromium driven over the DevTools protocol, for tier-2 browser tests.

No browser-automation package: the protocol is JSON over one websocket, and ``aiohttp`` (which
ComfyUI itself requires, so it is there whenever tier 2 runs) speaks websockets. The browser
binary is the system's Chromium (``CHROMIUM`` env, else ``chromium``/``chromium-browser``/
``google-chrome`` on PATH); nothing is downloaded.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.request

# Flags that work in containers without a GPU or a display; networking and update services off
# so a run touches nothing but the local ComfyUI server.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
)


def find_chromium() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class PageError(AssertionError):
    pass


class Browser:
    """One headless Chromium with one page; every call blocks until the browser answered."""

    def __init__(self, executable: str, width: int = 1400, height: int = 900):
        self.executable = executable
        self.width, self.height = width, height
        self.profile = pathlib.Path(tempfile.mkdtemp(prefix="fvd-chromium-"))
        self.console: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._loop = asyncio.new_event_loop()
        self._proc: subprocess.Popen | None = None
        self._session = None
        self._ws = None
        self._reader = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "Browser":
        cmd = [self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
               "--remote-debugging-port=0", f"--window-size={self.width},{self.height}",
               "about:blank"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                      stderr=open(self.profile / "chromium.log", "wb"))
        port = self._devtools_port(timeout)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.loads(r.read())
        page = next(t for t in targets if t.get("type") == "page")
        self._run(self._connect(page["webSocketDebuggerUrl"]))
        self.send("Runtime.enable")
        self.send("Page.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        return self

    def _devtools_port(self, timeout: float) -> int:
        # Chromium writes the port it picked for --remote-debugging-port=0 into the profile.
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("Chromium exited early:\n" + self.log_text()[-3000:])
            if marker.exists():
                first = marker.read_text().splitlines()[:1]
                if first and first[0].strip().isdigit():
                    return int(first[0])
            time.sleep(0.1)
        raise TimeoutError("Chromium did not open its DevTools port:\n" + self.log_text()[-3000:])

    def log_text(self) -> str:
        log = self.profile / "chromium.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def close(self) -> None:
        try:
            if self._ws is not None:
                self._run(self._disconnect())
        finally:
            if self._proc and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(15)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            self._loop.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    # -- protocol ----------------------------------------------------------------------------

    def _run(self, coro, timeout: float | None = None):
        if timeout is not None:
            coro = asyncio.wait_for(coro, timeout)
        return self._loop.run_until_complete(coro)

    async def _connect(self, url: str) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())

    async def _disconnect(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self._ws.close()
        await self._session.close()

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            future = self._pending.pop(data.get("id"), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in args)
                self.console.append(f"{data['params'].get('type')}: {text}")
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                self.console.append(f"exception: {text}")

    async def _call(self, method: str, params: dict) -> dict:
        msg_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[msg_id] = future
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        return await future

    def send(self, method: str, timeout: float = 60.0, **params) -> dict:
        reply = self._run(self._call(method, params), timeout)
        if "error" in reply:
            raise PageError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    # -- page helpers ------------------------------------------------------------------------

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str, timeout: float = 60.0):
        """The JSON value of ``expression`` (awaited if it is a promise); page errors raise."""
        result = self.send("Runtime.evaluate", timeout=timeout, expression=expression,
                           awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise PageError(f"page error in {expression[:200]!r}:\n{text}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60.0, interval: float = 0.25):
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
                if value:
                    return value
            except PageError as e:  # the page may still be loading its modules
                last_error = e
            time.sleep(interval)
        tail = "\n".join(self.console[-30:])
        raise TimeoutError(f"timed out waiting for {expression!r} (last error: {last_error})\n"
                           f"console:\n{tail}")

    def screenshot(self, path: pathlib.Path, clip: dict | None = None,
                   scale: float = 1.0) -> pathlib.Path:
        """PNG, or JPEG when ``path`` ends in .jpg; ``clip`` in CSS pixels, ``scale`` resizes."""
        jpeg = path.suffix.lower() in (".jpg", ".jpeg")
        params = {"format": "jpeg", "quality": 85} if jpeg else {"format": "png"}
        if clip:
            params["clip"] = {**clip, "scale": scale}
        data = self.send("Page.captureScreenshot", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
