"""cuDNN's graph API (``nvidia-cudnn-frontend``, optional) beside the pack's convs: does letting
cuDNN fuse a resnet block's closing add into the conv beat the conv plus the pack's pass?

For each 2-D conv the fused path runs on cuDNN (``convs``' shapes with the ``conv2d`` route),
``convs --cudnn-graph`` times, all bf16 channels-last without autotuning, the fastest of the
plans cuDNN offers for each graph (heuristics A, then the fallback list; the first
``MAX_PLANS``):

- ``pass_ms``: ``F.conv2d`` (no bias) then ``bias_residual_add_`` -- what a resnet block's
  conv2 costs the pack today without the statistics hand-off;
- ``stats_pass_ms``: the same conv then ``add_bias_residual_group_stats_`` (32 groups) -- today's
  default, which also takes the next norm's statistics in the same sweep;
- ``conv_ms``: the conv alone as a one-node graph (does the route itself cost anything?);
- ``epilogue_ms``: conv -> +bias -> +residual as one graph;
- ``genstats_ms``: that graph also producing per-channel sums and sums of squares (cuDNN's
  ``genstats``), what a group norm's statistics could be finished from;
- ``prologue_ms``: ``x * scale + shift -> swish -> conv -> +bias``: GroupNorm's apply and SiLU
  as the conv's prologue.

A graph cuDNN cannot serve is noted with cuDNN's reason. The measured H200 numbers and what they
decided: ``docs/benchmark/convs/cudnn-graph.md``. Nothing in the decode path imports this.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

from .convs import _fmt
from .timing import queued_ms

MAX_PLANS = 8
GROUPS = 32  # the KL decoders' GroupNorm groups (statistics kernel for stats_pass_ms)
FIELDS = ("pass_ms", "stats_pass_ms", "conv_ms", "epilogue_ms", "genstats_ms", "prologue_ms")
INSTALL_HINT = "pip install nvidia-cudnn-frontend (optional; only this measurement uses it)"


def unavailable_reason() -> str | None:
    """Why the graph measurement cannot run here (no CUDA GPU, no frontend), else None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # ImportError, or a frontend that cannot find libcudnn
        return f"needs nvidia-cudnn-frontend ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def graph_shapes(results) -> list:
    """The ``convs`` results the graphs apply to: 2-D convs on cuDNN in channels-last."""
    return [r for r in results if r.shape.route == "conv2d" and len(r.shape.kernel) == 2]


def _cl_stride(n: int, c: int, h: int, w: int) -> list[int]:
    return [c * h * w, 1, w * c, c]


def _build(kind: str, x, w, b, r, scale, shift, handle) -> tuple[Callable[[], None], str, dict]:
    """The fastest plan of graph ``kind`` (conv | epilogue | genstats | prologue) as a call,
    its plan name, and the output tensors it writes."""
    import cudnn

    bf16, fp32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32,
                      handle=handle)
    X = g.tensor(dim=list(x.shape), stride=_cl_stride(n, c, h, wd), data_type=bf16, name="X")
    W = g.tensor(dim=list(w.shape), stride=_cl_stride(k, c, kh, kw), data_type=bf16, name="W")
    io = {X: x, W: w}
    image = X
    if kind == "prologue":
        S = g.tensor(dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=bf16, name="S")
        T = g.tensor(dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=bf16, name="T")
        io.update({S: scale, T: shift})
        image = g.swish(g.bias(g.scale(X, S, name="scale"), T, name="shift"), name="silu")
    pad = [kh // 2, kw // 2]
    Y = g.conv_fprop(image=image, weight=W, padding=pad, stride=[1, 1], dilation=[1, 1],
                     compute_data_type=fp32, name="conv")
    if kind != "conv":
        B = g.tensor(dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=bf16, name="B")
        io[B] = b
        Y = g.bias(Y, B, name="bias")
    if kind in ("epilogue", "genstats"):
        R = g.tensor(dim=[n, k, h, wd], stride=_cl_stride(n, k, h, wd), data_type=bf16, name="R")
        io[R] = r
        Y = g.add(Y, R, name="residual")
    Y.set_output(True).set_data_type(bf16).set_stride(_cl_stride(n, k, h, wd))
    out = torch.empty(n, k, h, wd, device=x.device, dtype=x.dtype).contiguous(
        memory_format=torch.channels_last)
    io[Y] = out
    outputs = {"y": out}
    if kind == "genstats":
        sums = g.genstats(Y, name="stats")
        for name, t in zip(("sum", "sq_sum"), sums, strict=True):
            t.set_output(True).set_data_type(fp32)
            buf = torch.empty(1, k, 1, 1, device=x.device, dtype=torch.float32)
            io[t] = buf
            outputs[name] = buf
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    best, notes = None, []
    for i in range(min(g.get_execution_plan_count(), MAX_PLANS)):
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), device=x.device,
                             dtype=torch.uint8)
            def call(i=i, ws=ws):
                g.execute_plan_at_index(io, ws, i, handle=handle)

            ms = _median_ms(call)
            if best is None or ms < best[0]:
                best = (ms, call, g.get_plan_name_at_index(i))
        except Exception as exc:  # a plan that does not build or run: the next one
            notes.append(f"{type(exc).__name__}: {exc}".splitlines()[0][:120])
    if best is None:
        raise RuntimeError("no plan built" + (f" ({notes[0]})" if notes else ""))
    return best[1], best[2], outputs


def _median_ms(fn: Callable[[], object], repeats: int = 25, warmup: int = 3) -> float:
    return statistics.median(queued_ms(fn, "cuda", repeats, warmup))


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def time_graphs(results, log=print) -> None:
    """Fill ``result.cudnn_graph`` of every ``graph_shapes`` result (see the module's note)."""
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    generator = torch.Generator().manual_seed(0)
    for result in graph_shapes(results):
        result.cudnn_graph = row = _time_shape(result.shape, handle, generator)
        log(f"{result.shape.label}: conv+pass {row['pass_ms']:.3f} ms, graph epilogue "
            f"{_fmt(row.get('epilogue_ms'))} ms")


def _time_shape(s, handle, generator) -> dict:
    import torch.nn.functional as F

    from ..kernels.bias_residual_add import bias_residual_add_
    from ..kernels.group_norm_silu import add_bias_residual_group_stats_

    n, c, h, wd = s.input
    cl = torch.channels_last

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to("cuda", torch.bfloat16)

    x = rand(n, c, h, wd).contiguous(memory_format=cl)
    w = rand(s.cout, c, *s.kernel, scale=1 / math.sqrt(c * s.kernel[0] * s.kernel[1]))
    w = w.contiguous(memory_format=cl)
    b, r = rand(s.cout, scale=0.1), rand(n, s.cout, h, wd).contiguous(memory_format=cl)
    scale, shift = 1 + rand(c, scale=0.1), rand(c, scale=0.1)
    pad = s.padding
    row: dict = {"plans": {}, "max_error": {}, "unsupported": {}}

    def conv_and_pass():
        bias_residual_add_(F.conv2d(x, w, None, padding=pad), b, r)

    def conv_and_stats_pass():
        add_bias_residual_group_stats_(F.conv2d(x, w, None, padding=pad), b, r, GROUPS)

    row["pass_ms"] = _median_ms(conv_and_pass)
    if s.cout % GROUPS == 0:
        row["stats_pass_ms"] = _median_ms(conv_and_stats_pass)
    ref = F.conv2d(x.float(), w.float(), b.float(), padding=pad) + r.float()
    act = F.silu(x.float() * scale.float()[None, :, None, None]
                 + shift.float()[None, :, None, None])
    refs = {"conv": F.conv2d(x.float(), w.float(), None, padding=pad), "epilogue": ref,
            "genstats": ref, "prologue": F.conv2d(act, w.float(), b.float(), padding=pad)}
    for kind, expected in refs.items():
        try:
            call, plan, outputs = _build(kind, x, w, b, r, scale, shift, handle)
            row[f"{kind}_ms"] = _median_ms(call)
            call()
            torch.cuda.synchronize()
            row["plans"][kind] = plan
            row["max_error"][kind] = _rel_error(outputs["y"], expected)
            if kind == "genstats":
                row["max_error"]["genstats_sum"] = _rel_error(
                    outputs["sum"].flatten(), outputs["y"].float().sum((0, 2, 3)))
        except Exception as exc:  # cuDNN declines the graph: say why, time the rest
            row["unsupported"][kind] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return row


def graph_markdown(results) -> str:
    """The graph table: per shape the pack's conv + pass against each graph (— where cuDNN
    declined), and the fastest plans' names."""
    rows = [r for r in results if getattr(r, "cudnn_graph", None)]
    out = ["| input | Cout | kernel | calls | conv + pass ms | conv + pass with statistics ms "
           "| graph conv ms | graph conv+bias+residual ms (vs conv + pass) "
           "| + genstats ms | norm+SiLU prologue ms | plans (conv; epilogue) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g, s = r.cudnn_graph, r.shape
        epi = g.get("epilogue_ms")
        change = "" if epi is None else f" ({100 * (epi / g['pass_ms'] - 1):+.0f}%)"
        plans = "; ".join(g.get("plans", {}).get(k, "—") for k in ("conv", "epilogue"))
        out.append(f"| {'x'.join(map(str, s.input))} | {s.cout} | {'x'.join(map(str, s.kernel))} "
                   f"| {sum(r.calls.values())} | {_fmt(g.get('pass_ms'))} "
                   f"| {_fmt(g.get('stats_pass_ms'))} | {_fmt(g.get('conv_ms'))} "
                   f"| {_fmt(epi)}{change} | {_fmt(g.get('genstats_ms'))} "
                   f"| {_fmt(g.get('prologue_ms')) if 'prologue' not in g.get('unsupported', {}) else 'unsupported'} "
                   f"| {plans} |")
    return "\n".join(out) + "\n"
