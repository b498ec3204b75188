"""Helpers every video family's fused convolutions share (Wan, LTX): the channels-last-3d
layout, the per-call check that a conv can run on the weights ComfyUI hands over, the conv
weight in the activations' layout (the KL image family's 2-D convs use that one too), and
summing a conv's partial outputs with its bias.
"""
from __future__ import annotations

import torch

from ..kernels.bias_residual_add import bias_residual_add_
from .cache import cached
from .comfyui.weights import bias_of, fetch_reason, is_stable, weight_of
from .reasons import AUTOGRAD

CL3D = torch.channels_last_3d


def to_cl3d(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=CL3D)


def to_cl(x: torch.Tensor) -> torch.Tensor:
    """Channels-last in the tensor's own rank (4-D images or 5-D video)."""
    return x.contiguous(memory_format=CL3D if x.dim() == 5 else torch.channels_last)


def conv_weights_reason(conv: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Per-call: ``F.conv*`` on the conv's raw weights computes what its stock forward does."""
    reason = fetch_reason(conv, x)
    if reason is not None:
        return reason
    for p in (weight_of(conv), bias_of(conv)):
        if p is None:
            continue
        if p.device != x.device:
            return f"weights on {p.device}, input on {x.device}"
        if p.dtype != x.dtype:  # F.conv3d does not mix dtypes; the stock path raises or casts
            return f"weights in {p.dtype}, input in {x.dtype}"
        if torch.is_grad_enabled() and p.requires_grad:
            return AUTOGRAD
    return None


def conv_weight(conv: torch.nn.Module, fmt: torch.memory_format) -> torch.Tensor:
    """The conv weight in ``fmt``: built once per weight version, dropped on unload.

    cuDNN runs channels-last activations against a channels-last weight; handing it the
    contiguous one makes PyTorch convert the weight on every call.
    """
    weight = weight_of(conv)
    if weight.is_contiguous(memory_format=fmt):
        return weight
    return cached(conv, f"weight:{fmt}", (weight,), lambda: weight.detach().contiguous(memory_format=fmt),
                  keep=is_stable(conv))


def add_parts(parts: list[torch.Tensor], bias: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(parts) + bias (+ residual)`` in one pass into ``parts[0]`` (torch if declined)."""
    out = parts[0]
    if bias_residual_add_(out, bias, residual, addends=tuple(parts[1:])) is not None:
        return out
    out = sum_parts(parts, bias)
    if residual is not None:
        out += residual
    return out


def sum_parts(parts: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """``sum(parts) + bias`` in torch, into ``parts[0]`` (where no fused consumer takes them)."""
    out = parts[0]
    for part in parts[1:]:
        out += part
    if bias is not None:
        out += bias.reshape(1, -1, 1, 1, 1)
    return out
