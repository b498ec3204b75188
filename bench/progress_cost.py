"""What ComfyUI progress reporting costs a decode of the node (issue: "cheap enough to leave on").

The node reports after each finished chunk (``nodes.progress.comfy_progress``: ComfyUI's
``ProgressBar`` update and its interrupt check). ``timed_progress`` wraps those reports while a
decode runs and adds up the host time spent in them. The reports never wait for the GPU, so
this is an upper bound on what they add to a decode. In-process there is no server: the
progress-bar hook set here only records the update, where the server's would queue one
websocket message.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator


@dataclass
class ProgressCost:
    updates: int = 0
    seconds: float = 0.0

    def as_info(self) -> dict:
        return {"progress_updates": self.updates, "progress_ms": self.seconds * 1e3}


@contextlib.contextmanager
def timed_progress() -> Iterator[ProgressCost]:
    import comfy.utils

    from ..nodes import fast_vae_decode as node

    cost = ProgressCost()
    real = node.comfy_progress

    def timed(bar: bool = True):
        report = real(bar)

        def timed_report(done: int, total: int) -> None:
            start = time.perf_counter()
            try:
                report(done, total)
            finally:
                cost.updates += 1
                cost.seconds += time.perf_counter() - start

        return timed_report

    hook = comfy.utils.PROGRESS_BAR_HOOK
    if hook is None:
        comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: None)
    node.comfy_progress = timed
    try:
        yield cost
    finally:
        node.comfy_progress = real
        comfy.utils.set_progress_bar_global_hook(hook)
