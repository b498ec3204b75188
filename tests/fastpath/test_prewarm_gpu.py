"""Kernel warm-up before a model's first fused decode (``fastpath/prewarm.py``), on a GPU.

Tier 3 (``cuda``): after warm-up the first real decode compiles no new kernel variant, at two
latent sizes (sizes are never specialized). The same code path on the CPU is tier 1, in
test_prewarm.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.fastpath import prewarm
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path

diffusers = pytest.importorskip("diffusers")
from support.kl_models import _latent, tiny_vae  # noqa: E402


@pytest.mark.cuda
def test_after_warm_up_a_decode_compiles_nothing_new():
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    model = tiny_vae(blocks=(128, 256, 512), groups=32).to("cuda", torch.bfloat16)
    install_fast_path(model)
    compiled = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(1)
    try:
        gate = gate_for(model)
        armed = list(gate.prewarm_modules)
        with torch.inference_mode(), gate.opened(True):
            # Warm up alone first (what the first fused call does), then decode two sizes.
            prewarm.warm_up(gate, _latent((1, 4, 8, 8), device="cuda", dtype=torch.bfloat16))
            before = len(compiled)
            for size in (24, 40):
                model.decode(_latent((1, 4, size, size), device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = old
    assert armed and len(compiled) == before, f"{len(compiled) - before} variants compiled after warm-up"
