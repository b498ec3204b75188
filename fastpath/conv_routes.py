"""Which convolutions of the fused decoders leave cuDNN for one of the pack's Triton convs.

Declared as data, chosen on the per-conv benchmark (``python -m fast_vae_decode convs``):
a route is taken only where its kernel beat the cuDNN call the fused path would otherwise make,
measured at the decoders' real shapes on the GPU. Everything else stays on cuDNN, and a route
whose kernel declines a call (dtype, layout, size) falls back to cuDNN for that call, so the
results are the cuDNN path's up to the rounding each kernel documents.

Only the open gate (``quality = "high"``) consults this; the closed gate is stock code.
"""
from __future__ import annotations

from dataclasses import dataclass

CUDNN = "cudnn"
NARROW_CONV = "narrow_conv"


@dataclass(frozen=True)
class ConvRoute:
    """Convolutions with at most ``max_cout`` outputs whose kernel, as the fused path runs it
    (a causal conv's first chunk meets fewer temporal taps), is one of ``kernels`` run on
    ``op``; ``measured`` records the numbers that chose the route."""

    op: str
    max_cout: int
    kernels: tuple[tuple[int, ...], ...]
    measured: str


ROUTES: tuple[ConvRoute, ...] = (
    # Wan's heads over three temporal taps: narrow_conv folds the taps into one GEMM and reads
    # each input pixel once. Not the 2-D heads: the SDXL/Flux 128 -> 3 head at 1024² was 0.390
    # ms at narrow_conv's default tiling against cuDNN's 0.369 (0.340 at the best tiling
    # tried: 1.08x, not worth its compile time); nor a causal head's uncached single frame
    # (Wan 2.1 1x96x1x480x832: 0.296 default / 0.174 best vs 0.192; Wan 2.2: 0.288 best vs
    # 0.263). (Those were timed one call per event pair; s45's queued timer reads the 2-D
    # head at 0.249 ms against cuDNN's 0.358 on an H100. The KL decoders now reach narrow_conv
    # anyway, with their last norm as its prologue: ``kl.settings.fused_head``.)
    ConvRoute(NARROW_CONV, max_cout=12, kernels=((3, 3, 3),),
              measured="H200, torch 2.11, Triton 3.6, bf16, 2026-12-01, default tiling: "
                       "Wan 2.1 head 1x96x6x480x832 -> 3: 0.496 ms vs cuDNN (2-D taps) 1.270 "
                       "(2.56x); Wan 2.2 head 1x256x6x352x640 -> 12: 1.047 vs cuDNN conv3d "
                       "1.685 (1.61x)"),
)


def conv_route(cout: int, kernel: tuple[int, ...]) -> str:
    """The op a fused module runs a stride-1 conv with ``cout`` outputs on, ``kernel`` the
    kernel it runs (2-D (KH, KW) or 3-D (KT, KH, KW))."""
    for route in ROUTES:
        if cout <= route.max_cout and tuple(kernel) in route.kernels:
            return route.op
    return CUDNN
