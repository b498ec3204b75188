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
    """Convolutions with at most ``max_cout`` outputs and a spatial kernel in ``spatial`` run
    on ``op``; ``measured`` records the numbers that chose the route."""

    op: str
    max_cout: int
    spatial: tuple[tuple[int, int], ...]
    measured: str


ROUTES: tuple[ConvRoute, ...] = (
    # Decoder heads (KL 128 -> 3 at 1024², Wan 2.1 96 -> 3 x 3 frames, Wan 2.2 256 -> 12): the
    # direct conv leaves the tensor cores idle and reads each input pixel once per tap.
    ConvRoute(NARROW_CONV, max_cout=12, spatial=((3, 3),),
              measured="see docs/benchmark: per-conv benchmark, head rows"),
)


def conv_route(cout: int, kernel_size: tuple[int, ...]) -> str:
    """The op a fused module runs a stride-1 conv with ``cout`` outputs and ``kernel_size`` on."""
    spatial = tuple(kernel_size[-2:])
    for route in ROUTES:
        if cout <= route.max_cout and spatial in route.spatial:
            return route.op
    return CUDNN
