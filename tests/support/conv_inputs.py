"""Inputs for the conv kernels' tests (implicit_gemm_conv, narrow_conv), tier 1 and 3."""
from __future__ import annotations

import pytest
import torch


def conv_tensors(shape, cout, kernel, device="cpu", seed=0):
    """Channels-last(-3d) bf16 input of ``shape``, a fan-in scaled [Cout, Cin, *kernel] weight
    and a small bias, all seeded."""
    g = torch.Generator(device=device).manual_seed(seed)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.randn(shape, generator=g, device=device).bfloat16().contiguous(memory_format=fmt)
    fan_in = shape[1] * torch.Size(kernel).numel()
    w = torch.randn((cout, shape[1], *kernel), generator=g, device=device) / fan_in**0.5
    b = torch.randn(cout, generator=g, device=device) * 0.1
    return x, w.bfloat16(), b.bfloat16()


@pytest.fixture(autouse=True)
def true_fp32_oracle():
    """The oracles' fp32 convolutions in true fp32 (cuDNN would otherwise round to TF32).
    Autouse in the modules that import it."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = previous
