"""What a kernel takes, declared once as data, and the helpers every kernel's checks share.

Each kernel module declares an ``Accepts`` (``GROUP_NORM_SILU``, ``RMS_NORM_SILU``, ...): the
ranks, dtypes, layout and channel/size limits of its main input. Two checks are built from it:

- ``channels_reason(channels, groups)``: shape only, so ``fastpath`` can ask it at install for a
  module it has not run yet (a norm of 8193 channels is left stock there, not at every call);
- ``tensor_reason(x)``: per call, on the tensor itself (Triton can run on it, rank, dtype,
  layout, batch and pixel limits). ``layout=False`` leaves the layout out for callers that
  convert the tensor in their fast path.

A kernel's own ``*_unsupported`` function is these two plus what only it knows (its weights,
addends, autograd); nothing outside this package restates a limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable

import torch

from .backend import triton_unavailable_reason

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
AUTOGRAD = "autograd (the kernel has no backward)"


def pow2(v: int) -> int:
    """The smallest power of two >= ``v`` (1 for v <= 1)."""
    return 1 << max(0, int(v) - 1).bit_length()


def same_layout(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Same shape and strides as ``x``; strides of size-1 dims carry no layout and are ignored.

    Tensors a kernel reads at ``x``'s offsets (addends, a residual) must be laid out like this.
    """
    return t.shape == x.shape and all(
        size == 1 or t.stride(d) == x.stride(d) for d, size in enumerate(x.shape)
    )


def autograd_reason(*tensors) -> str | None:
    """``AUTOGRAD`` when grad mode is on and one of ``tensors`` requires grad."""
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    ):
        return AUTOGRAD
    return None


# --- layouts -------------------------------------------------------------------------------


def channels_last_4d(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.permute(0, 2, 3, 1).is_contiguous()


def channels_inner_dense(x: torch.Tensor) -> bool:
    """Channels innermost and the whole tensor dense (NHWC / NDHWC); ``is_contiguous`` ignores
    the strides of size-1 dims, so batch-1 slices along T pass."""
    return x.dim() >= 2 and x.movedim(1, -1).is_contiguous()


def channel_stride_one(x: torch.Tensor) -> bool:
    """Each pixel's channels are contiguous (stride 1); the other strides may be anything
    (kernels that take it compute every pixel's offset from the strides)."""
    return x.dim() >= 2 and (x.shape[1] == 1 or x.stride(1) == 1)


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def pixels_dense(x: torch.Tensor) -> bool:
    """Within each sample, pixels are rows of C contiguous channels.

    That is channels-last(-3d) up to the batch stride, which may be anything (a time slice of a
    channels-last-3d batch keeps dense samples but not a dense batch). Size-1 dims carry no
    layout, so their strides are ignored.
    """
    # torch's own channels-last test ignores size-1 dims the same way and is checked in C++:
    # the common case answers without the loop (host time on every launch of a decode).
    fmt = _CHANNELS_LAST.get(x.dim())
    if fmt is not None and x.numel() and x.is_contiguous(memory_format=fmt):
        return True
    return pixels_dense_by_strides(x)


def pixels_dense_by_strides(x: torch.Tensor) -> bool:
    """``pixels_dense``'s definition, walked over the strides (its test's oracle)."""
    expected = 1
    for dim in [1] + list(range(x.dim() - 1, 1, -1)):
        if x.shape[dim] != 1 and x.stride(dim) != expected:
            return False
        expected *= x.shape[dim]
    return True


def contiguous(x: torch.Tensor) -> bool:
    return x.is_contiguous()


# --- the declaration -----------------------------------------------------------------------


@dataclass(frozen=True)
class Accepts:
    """The main input one kernel takes. Limits left None do not apply."""

    min_rank: int
    max_rank: int | None = None  # None: any rank from min_rank on
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    layout: Callable[[torch.Tensor], bool] | None = None
    layout_reason: str = "not channels-last"
    nonempty: bool = True  # False: an empty tensor is the kernel's no-op
    max_block_c: int | None = None  # all channels, rounded up to a power of two, in one tile row
    max_group_mask: int | None = None  # pow2(groups) * pow2(C) for groups of non-power-of-two width
    max_channels: int | None = None
    max_batch: int | None = None  # CUDA's grid limit where the batch is a grid axis
    max_pixels: int | None = None  # spatial elements per sample, exclusive

    def rank_reason(self, rank: int) -> str | None:
        if rank >= self.min_rank and (self.max_rank is None or rank <= self.max_rank):
            return None
        if self.max_rank is None:
            needs = f"at least {self.min_rank}-D"
        elif self.max_rank == self.min_rank:
            needs = f"{self.min_rank}-D"
        else:
            needs = " or ".join(f"{r}-D" for r in range(self.min_rank, self.max_rank + 1))
        return f"{rank}-D input (needs {needs})"

    def channels_reason(self, channels: int, groups: int | None = None) -> str | None:
        """Why the kernel can never take ``channels`` (in ``groups`` groups); shape only."""
        if groups is not None and (groups <= 0 or channels % groups):
            return f"{channels} channels not divisible into {groups} groups"
        if self.max_channels is not None and channels > self.max_channels:
            return f"{channels} channels (at most {self.max_channels})"
        if self.max_block_c is not None and pow2(channels) > self.max_block_c:
            return f"{channels} channels is too wide for one tile"
        if groups is not None and self.max_group_mask is not None:
            cpg = channels // groups
            if cpg != pow2(cpg) and pow2(groups) * pow2(channels) > self.max_group_mask:
                return f"{groups} groups of {cpg} channels"
        return None

    def tensor_reason(self, x: torch.Tensor, *, layout: bool = True,
                      rank: int | None = None) -> str | None:
        """Per call: why the kernel cannot take ``x`` as its main input (channel rules apart,
        see ``channels_reason``); ``rank`` narrows the ranks to one (a caller's own need)."""
        reason = triton_unavailable_reason(x)
        if reason is not None:
            return reason
        if rank is not None and x.dim() != rank:
            return f"{x.dim()}-D input (needs {rank}-D)"
        reason = self.rank_reason(x.dim())
        if reason is not None:
            return reason
        if x.dtype not in self.dtypes:
            return f"dtype {x.dtype}"
        if self.nonempty and x.numel() == 0:
            return "empty tensor"
        if layout and self.layout is not None and not self.layout(x):
            return self.layout_reason
        if self.max_batch is not None and x.shape[0] > self.max_batch:
            return f"batch {x.shape[0]} (at most {self.max_batch})"
        if self.max_pixels is not None and prod(x.shape[2:]) >= self.max_pixels:
            n = self.max_pixels
            limit = f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)
            return f"{limit} or more pixels per sample"
        return None
