"""Kernel warm-up before a model's first fused decode (``fastpath/prewarm.py``), on a GPU.

Tier 3 (``cuda``): after warm-up the first real decode compiles no new kernel variant, at two
latent sizes (sizes are never specialized). The same code path on the CPU is tier 1, in
test_prewarm.py.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fast_vae_decode.fastpath import prewarm
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path

diffusers = pytest.importorskip("diffusers")
from support.kl_models import _latent, tiny_vae  # noqa: E402


@contextlib.contextmanager
def counting_compiles():
    """A list that gets one entry per kernel variant Triton compiles inside the block."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    compiled = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(1)
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = old


@pytest.mark.cuda
def test_after_warm_up_a_decode_compiles_nothing_new():
    model = tiny_vae(blocks=(128, 256, 512), groups=32).to("cuda", torch.bfloat16)
    install_fast_path(model)
    with counting_compiles() as compiled:
        gate = gate_for(model)
        armed = list(gate.prewarm_modules)
        with torch.inference_mode(), gate.opened(True):
            # Warm up alone first (what the first fused call does), then decode two sizes.
            prewarm.warm_up(gate, _latent((1, 4, 8, 8), device="cuda", dtype=torch.bfloat16))
            before = len(compiled)
            for size in (24, 40):
                model.decode(_latent((1, 4, size, size), device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
    assert armed and len(compiled) == before, f"{len(compiled) - before} variants compiled after warm-up"


@pytest.mark.cuda
@pytest.mark.parametrize("kind,shape", [("wan21", (1, 4, 3, 8, 12)), ("wan22", (1, 8, 3, 8, 12))])
def test_after_warm_up_a_wan_decode_compiles_nothing_new(kind, shape):
    """The Wan decoders on a GPU, where narrow convs run as per-tap 2-D convs (a second tap
    part for the norms to fold in) and steady chunks read the frame cache."""
    from support.wan_models import latent as wan_latent
    from support.wan_models import tiny_wan

    model = tiny_wan(kind).to("cuda", torch.bfloat16)
    install_fast_path(model)
    with counting_compiles() as compiled:
        gate = gate_for(model)
        z = wan_latent(shape).to("cuda", torch.bfloat16)
        with torch.inference_mode(), gate.opened(True):
            prewarm.warm_up(gate, z)  # what the first fused call does, on the latent's frame
            before = len(compiled)
            model.decode(z)
            torch.cuda.synchronize()
    assert len(compiled) == before, f"{len(compiled) - before} variants compiled after warm-up"
