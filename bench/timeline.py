"""Where an unprofiled decode's GPU runs out of work: CUDA events at module calls
(``profile --timeline``).

Under torch's profiler the host runs about twice as slow as without it (each op is recorded),
so ``gpu_profile``'s host-late idle overstates where the GPU waits wherever host and GPU are
close in speed. Wan 2.1 x33 ``high`` on ComfyUI 0.33 (H200): the profiled trace put host-late
idle in every tenth of the decode; unprofiled, the GPU waited only during the first decoder
call and the start of the second, and from there on the host stayed 17-39 ms ahead.

Here a forward pre-hook on the model and its modules down to ``depth`` records a CUDA event
and the host clock at each call, nothing else. After the decode each event's GPU time is put on
the host clock through a reference event recorded while the GPU was idle. At a hook:

    lag = GPU time - host time

the work queued ahead of the GPU when the host reached that call. A lag under ``DRY_MS`` means
the GPU had run dry and was waiting for that very launch. The two clocks agree to about 0.1 ms
(the reference's launch latency against each hook's: lags of -0.1 ms were seen on the H200).

The summary is a pure function of the recorded rows (``summarise``), tested without a GPU.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# Launch latency: a hook the GPU reaches within this of the host issuing it found the GPU idle.
DRY_MS = 0.15
ROOT = "<model>"


@dataclass(frozen=True)
class Hook:
    name: str  # the module's name in the model (ROOT for the model itself)
    host_ms: float  # host clock at the call, from the reference
    gpu_ms: float  # when the GPU reached the call, from the reference

    @property
    def lag_ms(self) -> float:
        return self.gpu_ms - self.host_ms


@dataclass(frozen=True)
class CallRow:
    """One call of the summarised module (a video decoder's chunk): from its own hook to the
    next call's (or the decode's end)."""

    index: int
    host_ms: float
    gpu_ms: float
    gpu_end_ms: float
    hooks: int
    dry_hooks: int  # hooks inside the call where the GPU was waiting (lag < DRY_MS)


@dataclass(frozen=True)
class Timeline:
    wall_ms: float
    gpu_end_ms: float
    hooks: int
    dry_hooks: int
    ahead_from_ms: float | None  # host time after which the GPU never waited again; None: never
    call_name: str
    calls: list[CallRow]


def _call_name(rows: list[Hook]) -> str:
    # A decoder that runs in chunks is the model's ``decoder`` child, called once per chunk;
    # otherwise the model itself.
    return "decoder" if any(r.name == "decoder" for r in rows) else ROOT


def summarise(rows: list[Hook], wall_ms: float, gpu_end_ms: float,
              dry_ms: float = DRY_MS) -> Timeline:
    """The timeline of one decode from its hooks, in call order."""
    name = _call_name(rows)
    starts = [i for i, r in enumerate(rows) if r.name == name]
    calls = []
    for n, start in enumerate(starts):
        stop = starts[n + 1] if n + 1 < len(starts) else len(rows)
        inside = rows[start:stop]
        end = rows[stop].gpu_ms if stop < len(rows) else gpu_end_ms
        calls.append(CallRow(n, rows[start].host_ms, rows[start].gpu_ms, end, len(inside),
                             sum(r.lag_ms < dry_ms for r in inside)))
    dry = [i for i, r in enumerate(rows) if r.lag_ms < dry_ms]
    ahead = None
    if not dry:
        ahead = rows[0].host_ms if rows else None
    elif dry[-1] + 1 < len(rows):
        ahead = rows[dry[-1] + 1].host_ms
    return Timeline(wall_ms, gpu_end_ms, len(rows), len(dry), ahead, name, calls)


@contextlib.contextmanager
def hooked(model: torch.nn.Module, depth: int = 3) -> Iterator[list]:
    """Inside: each call of ``model`` or of a module at most ``depth`` levels below it appends
    (name, host clock, recorded CUDA event) to the yielded list."""
    records: list = []

    def pre(name: str):
        def hook(module, args):
            # The host clock before the record, as for the reference: on an idle GPU both
            # then see the same launch latency.
            event = torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            event.record()
            records.append((name, host, event))
        return hook

    handles = [module.register_forward_pre_hook(pre(name or ROOT))
               for name, module in model.named_modules()
               if not name or name.count(".") < depth]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def record(model: torch.nn.Module, decode: Callable[[], Any], device: torch.device,
           depth: int = 3) -> Timeline:
    """The timeline of one ``decode()`` of ``model`` (CUDA only)."""
    with torch.cuda.device(device), hooked(model, depth) as records:
        torch.cuda.synchronize()
        reference = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter()
        reference.record()
        torch.cuda.synchronize()  # the GPU was idle: the reference ran as it was issued
        origin = before
        decode()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - origin) * 1e3
        rows = [Hook(name, (host - origin) * 1e3, reference.elapsed_time(event))
                for name, host, event in records]
        return summarise(rows, wall, reference.elapsed_time(end))


def timeline_markdown(t: Timeline) -> str:
    ahead = ("never" if t.ahead_from_ms is None else f"from {t.ahead_from_ms:.1f} ms on")
    lines = [
        f"timeline (unprofiled, one decode): wall {t.wall_ms:.1f} ms, GPU done at "
        f"{t.gpu_end_ms:.1f} ms; the GPU was waiting at {t.dry_hooks} of {t.hooks} module "
        f"calls; the host stayed ahead {ahead}",
        "",
        f"| `{t.call_name}` call | host issued it at ms | GPU reached it at ms | lag ms "
        f"| GPU done with it at ms | module calls | GPU waiting at |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c.index} | {c.host_ms:.1f} | {c.gpu_ms:.1f} | {c.gpu_ms - c.host_ms:.1f} "
              f"| {c.gpu_end_ms:.1f} | {c.hooks} | {c.dry_hooks} |" for c in t.calls]
    return "\n".join(lines)
