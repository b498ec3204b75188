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


# 2^31 + 2^20 elements at 128 channels: the last rows' element offsets exceed int32.
PAST_INT32_SHAPE = (1, 128, 4104, 4096)


def past_int32_input() -> torch.Tensor:
    """A channels-last bf16 CUDA input of ``PAST_INT32_SHAPE``, standard normal."""
    x = torch.empty(PAST_INT32_SHAPE, device="cuda", dtype=torch.bfloat16,
                    memory_format=torch.channels_last)
    return x.normal_()


def check_edge_rows(y: torch.Tensor, x: torch.Tensor, reference, tol: float) -> None:
    """The first and last 8 output rows of a 3x3, padding-1 conv ``y`` of ``x`` against
    ``reference`` (a function of an input) on the 9 input rows each run reads: the last rows
    are where offsets past int32 would show."""
    tail = x[:, :, -9:].contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y[:, :, -8:].float(), reference(tail)[:, :, 1:].float(),
                               rtol=tol, atol=tol)
    head = x[:, :, :9].contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y[:, :, :8].float(), reference(head)[:, :, :8].float(),
                               rtol=tol, atol=tol)
