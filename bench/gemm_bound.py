"""What the best GEMM library on this GPU does with each conv's own matrix product.

An implicit-GEMM convolution -- cuDNN's, CUTLASS's, the pack's Triton one -- computes an
``M x N x K`` product (``M`` output pixels, ``N`` output channels, ``K`` input channels times
taps) while gathering its ``M x K`` operand from the activation on the fly. A dense GEMM of the
same dims on an operand that is already laid out is the ceiling such a conv can reach without
fusing other work into it, where the product is compute-bound. (Where it is not -- few output
channels, a head conv -- the dense operand, taps times the activation's bytes, makes the GEMM
the slower one, and the conv is already past what it shows.) ``convs --gemm-bound`` times that GEMM (``torch.mm``, i.e. cuBLAS;
bf16, activations row-major as channels-last stores them) per conv shape and adds the per-case
sums, so issue 13's question -- can a conv kernel from any library beat cuDNN here, and by how
much per decode -- has a number before anyone writes one. Where cuDNN's conv already runs at the
GEMM's speed only fusion (a prologue or epilogue) can save time; where it does not, the gap is
the most a better conv kernel can win.

Nothing in the decode path imports this.
"""
from __future__ import annotations

import math

import torch

from .convs import ConvResult, ConvShape, _fmt, _median_ms

# The bound's M x K operand is materialised; shapes whose operand would pass this are left
# untimed (noted) rather than risking the run's memory. Wan 2.2's largest conv needs ~12 GiB.
MAX_OPERAND_BYTES = 16 << 30


def gemm_dims(shape: ConvShape) -> tuple[int, int, int]:
    """(M, N, K) of the product the conv computes: ``2 * M * N * K == shape.flops``."""
    out = shape.output
    m = out[0] * math.prod(out[2:])
    taps = 4 if shape.route == "transposed" else math.prod(shape.kernel)
    return m, shape.cout, shape.input[1] * taps


def time_gemms(results: list[ConvResult], *, repeats: int = 5, warmup: int = 2, log=print,
               device: str = "cuda") -> None:
    """Set each timed result's ``gemm_ms`` (the note says why where it is left None)."""
    device = torch.device(device)
    for r in results:
        if r.cudnn_ms is None:
            continue
        m, n, k = gemm_dims(r.shape)
        if m * k * 2 > MAX_OPERAND_BYTES:
            r.gemm_note = (f"M x K operand of {m * k * 2 / 2**30:.1f} GiB, over the "
                           f"{MAX_OPERAND_BYTES / 2**30:.1f} GiB limit")
            continue
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        r.gemm_ms = _median_ms(lambda a=a, w=w: torch.mm(a, w.t()), repeats, warmup, device)
        log(f"{r.shape.label}: GEMM {m}x{n}x{k} {_fmt(r.gemm_ms)} ms, cuDNN {_fmt(r.cudnn_ms)} ms")
        del a, w


def gemm_markdown(results: list[ConvResult]) -> str:
    """Per shape cuDNN's conv against the GEMM of its dims; per case the conv time of one
    decode at cuDNN's speed and at the faster of the two per shape (a shape left untimed, or
    one where the GEMM is slower, counts cuDNN's time)."""
    rows = [r for r in results if r.gemm_ms is not None or r.gemm_note]
    cases = list(dict.fromkeys(c for r in rows for c in r.calls))
    out = ["| kind | input | Cout | kernel | calls | M x N x K | cuDNN ms | cuDNN TFLOP/s "
           "| GEMM ms | GEMM TFLOP/s | cuDNN / GEMM |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r.shape
        m, n, k = gemm_dims(s)
        ratio = (f"{r.cudnn_ms / r.gemm_ms:.2f}x" if r.gemm_ms and r.cudnn_ms
                 else (r.gemm_note or "—"))
        out.append(f"| {s.kind} | {'x'.join(map(str, s.input))} | {s.cout} | {s.kernel_text} "
                   f"| {sum(r.calls.values())} | {m}x{n}x{k} | {_fmt(r.cudnn_ms)} "
                   f"| {_fmt(r.tflops(s.flops, r.cudnn_ms), 0)} | {_fmt(r.gemm_ms)} "
                   f"| {_fmt(r.tflops(s.flops, r.gemm_ms), 0)} | {ratio} |")
    out += ["", "| case | convs | cuDNN ms | at GEMM speed where faster ms | difference ms |",
            "| --- | --- | --- | --- | --- |"]
    for case in cases:
        timed = [r for r in rows if r.calls.get(case) and r.cudnn_ms is not None]
        cudnn = sum(r.cudnn_ms * r.calls[case] for r in timed)
        bound = sum(min(r.cudnn_ms, r.gemm_ms or math.inf) * r.calls[case] for r in timed)
        out.append(f"| {case} | {sum(r.calls[case] for r in timed)} | {cudnn:.2f} "
                   f"| {bound:.2f} | {cudnn - bound:.2f} |")
    return "\n".join(out) + "\n"
