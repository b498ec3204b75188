"""What the KL and Wan wings share to run a conv on ``kernels.padded_grid_conv``: whether a
call may (a bf16 CUDA input on a device where the optional DSL runs) and the conv's packed
weight, kept once per weight version like every other fold."""
from __future__ import annotations

import torch

from ..kernels.padded_grid_conv import dsl_unavailable_reason, pack_padded_grid_weight
from .cache import cached
from .comfyui.weights import is_stable, weight_of


def grid_device_ready(x: torch.Tensor) -> bool:
    """A bf16 CUDA tensor on a device where the DSL kernel runs (Hopper, DSL installed)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and dsl_unavailable_reason(x.device) is None


def packed_grid_weight(conv: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """``conv``'s weight as ``padded_grid_conv``'s B operand, or None where it is not in
    ``dtype`` (the kernel reads input and weight in one dtype)."""
    weight = weight_of(conv)
    if weight.dtype != dtype:
        return None
    return cached(conv, "padded_grid", (weight,),
                  lambda: pack_padded_grid_weight(weight.detach()), keep=is_stable(conv))
