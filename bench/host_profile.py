"""Where one decode's host time goes: ``cProfile`` over one decode, summarised by function
(``profile --host-top N``).

The GPU trace (``gpu_profile``) says *when* the GPU waited on the host; this says *which Python
functions* the host was in. Times are inflated by the profiler's own cost per call (roughly
doubling cheap functions), so read them as a ranking and as call counts, not as milliseconds to
subtract. The decode's final device-to-host copy waits for the GPU, so that wait shows up in
whichever function issues it; ``own_ms`` of the ComfyUI and pack functions above it is host work.
"""
from __future__ import annotations

import cProfile
import os
import pstats
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class HostRow:
    where: str  # "file:line(function)", the file relative to its package
    calls: int
    own_ms: float  # time in the function itself
    total_ms: float  # with what it called


def _short(filename: str) -> str:
    # The last two path parts name the module well enough ("kernels/direct_launch.py") and keep
    # ComfyUI trees, venvs and the pack's checkout out of the table.
    parts = filename.replace(os.sep, "/").split("/")
    return "/".join(parts[-2:])


def host_rows(stats: pstats.Stats, top: int, by: str = "own") -> list[HostRow]:
    """The ``top`` functions of ``stats`` by own time (``by="own"``) or with callees ("total")."""
    rows = []
    for (filename, line, function), (_, calls, own, total, _) in stats.stats.items():
        where = f"{_short(filename)}:{line}({function})" if line else function
        rows.append(HostRow(where, calls, own * 1e3, total * 1e3))
    key = (lambda r: r.own_ms) if by == "own" else (lambda r: r.total_ms)
    return sorted(rows, key=key, reverse=True)[:top]


def profile_host(call: Callable[[], Any]) -> tuple[pstats.Stats, Any]:
    """(stats, result) of one ``call()`` under cProfile."""
    profiler = cProfile.Profile()
    result = profiler.runcall(call)
    return pstats.Stats(profiler), result


def host_markdown(stats: pstats.Stats, top: int) -> str:
    """Two tables: the functions the host spent most time in, and those that led to most."""
    lines = [f"host (cProfile, one decode): {stats.total_calls} calls, "
             f"{stats.total_tt * 1e3:.1f} ms profiled", ""]
    for by, title in (("own", "own ms"), ("total", "with callees ms")):
        lines += ["| function | calls | own ms | with callees ms |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r.where[:100]}` | {r.calls} | {r.own_ms:.2f} | {r.total_ms:.2f} |"
                  for r in host_rows(stats, top, by)]
        lines += ["", f"(sorted by {title})", ""]
    return "\n".join(lines)
