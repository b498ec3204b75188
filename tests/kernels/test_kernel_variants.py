"""How many Triton compilations the pack's pointwise and group-norm kernels need.

Each distinct variant adds to a model's first fast decode (the warm-up compiles them in
parallel, but the compiler's front end holds the GIL). Where a flag costs nothing at run time
(the bias / residual pass, the group norm's finalize and apply), which operands a call passes
is a runtime flag, and a decoder's calls on one channel width share one variant. (The RMS
norm's operand flags stay constexprs: as runtime flags it ran up to 32% slower.)
``variant_key`` must also tell apart what Triton does specialize (an int's ``== 1`` and
``% 16`` class), or the warm-up would compile one variant where a decode meets two.

Tier 1: launches are recorded, not run (``recording_launches``).
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.backend import recording_launches, triton, variant_key
from fast_vae_decode.kernels.bias_residual_add import bias_residual_add_
from fast_vae_decode.kernels.group_norm_silu import group_norm_silu

pytestmark = pytest.mark.skipif(triton is None, reason="needs Triton")

DT = torch.bfloat16


def _cl3d(c: int, frames: int = 2, size: int = 6) -> torch.Tensor:
    return torch.randn(1, c, frames, size, size, dtype=DT).contiguous(
        memory_format=torch.channels_last_3d)


def _keys(calls) -> list[set]:
    """One set of variant keys per kernel launched, over every call in ``calls``."""
    with recording_launches() as recorded:
        for call in calls:
            assert call() is not None
    by_kernel: dict = {}
    for record in recorded:
        by_kernel.setdefault(record[0], set()).add(variant_key(record))
    return list(by_kernel.values())


def test_bias_residual_add_operands_share_one_variant():
    out = _cl3d(96)
    bias = torch.randn(96, dtype=DT)
    calls = [
        lambda: bias_residual_add_(out, bias),
        lambda: bias_residual_add_(out, bias, out.clone()),
        lambda: bias_residual_add_(out, None, out.clone()),
        lambda: bias_residual_add_(out, bias, addends=(out.clone(), out.clone())),
    ]
    assert [len(k) for k in _keys(calls)] == [1]


def test_group_norm_finalize_and_apply_share_variants_across_bias_silu_and_widths():
    """The finalize pass compiles once for every KL width (groups of up to 16 channels) with
    or without a bias; the apply pass once per width, with or without SiLU."""
    def norm(c: int, biased: bool, silu: bool):
        x = torch.randn(1, c, 4, 4, dtype=DT).contiguous(memory_format=torch.channels_last)
        b = torch.zeros(c, dtype=DT) if biased else None
        return lambda: group_norm_silu(x, torch.ones(c, dtype=DT), b, 32, 1e-6, silu=silu)

    with recording_launches() as recorded:
        for call in (norm(128, True, True), norm(512, True, False), norm(256, False, True),
                     norm(512, True, True)):
            assert call() is not None
    finalize = {variant_key(r) for r in recorded if r[0].__name__ == "_group_norm_finalize_kernel"}
    apply = {variant_key(r) for r in recorded if r[0].__name__ == "_group_norm_apply_kernel"}
    assert len(finalize) == 1
    assert len(apply) == 3  # 128, 256, 512 channels; SiLU on and off at 512 share one


def test_variant_key_tells_apart_the_ints_triton_specializes():
    """An int Triton specializes on (not in ``do_not_specialize``) gives another key for 1, a
    multiple of 16 and anything else; one it does not specialize on gives the same key."""
    import triton.language as tl

    @triton.jit(do_not_specialize=["free"])
    def kernel(ptr, pinned, free, BLOCK: tl.constexpr):
        tl.store(ptr + tl.arange(0, BLOCK), pinned + free)

    t = torch.zeros(4)

    def key(pinned: int, free: int) -> tuple:
        return variant_key((kernel, (1,), (t, pinned, free), {"BLOCK": 4}))

    assert len({key(1, 0), key(16, 0), key(7, 0)}) == 3
    assert key(7, 0) == key(9, 0)  # same class: neither 1 nor a multiple of 16
    assert key(7, 0) == key(7, 1) == key(7, 32)  # ``free`` is not specialized
