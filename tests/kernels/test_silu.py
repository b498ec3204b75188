"""``kernels.silu``: where SiLU's MUFU form may be compiled, and that the norm kernels compile
it for Hopper when asked (the interpreter cannot run inline PTX, so tier 1 checks the PTX;
tier 3 runs it against the reference in test_group_norm_silu_gpu.py and
test_rms_norm_silu_gpu.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fast_vae_decode.kernels import silu as silu_mod
from fast_vae_decode.kernels.silu import fast_silu_reason, use_fast_silu


def test_fast_form_needs_an_nvidia_gpu_without_the_interpreter(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert "cpu" in fast_silu_reason(torch.device("cpu"))
    monkeypatch.setattr(silu_mod, "interpreting", lambda: True)
    assert "interpreter" in fast_silu_reason(cuda)
    monkeypatch.setattr(silu_mod, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert "ROCm" in fast_silu_reason(cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert fast_silu_reason(cuda) is None
    assert use_fast_silu(True, cuda) and not use_fast_silu(False, cuda)
    assert not use_fast_silu(True, torch.device("cpu"))


# Both norm kernels for sm_90 (PTX only: no GPU needed), once per SiLU form: the MUFU form is
# the two flush-to-zero approximations and no IEEE-style fix-ups, and the library form has
# neither ftz instruction. Skipped where this Triton cannot compile ahead of time.
_HOPPER_PTX = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        sys.exit(77)
    from fast_vae_decode.kernels import group_norm_silu as gns
    from fast_vae_decode.kernels import rms_norm_silu as rms

    FLOATS = {"scale", "eps", "bias_scalar"}

    def ptx(kernel, consts):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in consts else "*bf16" if n.endswith("_ptr") and n not in (
            "scale_ptr", "shift_ptr") else "*fp32" if n.endswith("_ptr") else
            "fp32" if n in FLOATS else "i32" for n in names}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except (TypeError, AttributeError) as exc:  # another Triton's compile API
            print(exc, file=sys.stderr)
            sys.exit(77)
        return compiled.asm["ptx"]

    def forms(code):
        return ("ex2.approx.ftz.f32" in code, "rcp.approx.ftz.f32" in code,
                sum(1 for line in code.splitlines() if line.strip().startswith(("ex2", "rcp"))))

    apply = {"C": 128, "BLOCK_P": 32, "BLOCK_C": 128, "PREFETCH": False}
    norm = {"OUT_STRIDED": False, "REFLECT": False, "N_ADDENDS": 0, "HAS_IN_BIAS": False,
            "HAS_GAMMA": True, "MEAN_EPS": False, "HAS_BIAS": False, "BLOCK_P": 32,
            "BLOCK_C": 32, "SPLIT": 3, "SLOTS": 1}
    for kernel, exact, fast in (
            (gns._group_norm_apply_kernel, {**apply, "FAST_SILU": False},
             {**apply, "FAST_SILU": True}),
            (rms._rms_norm_silu_kernel, {**norm, "SILU": 1}, {**norm, "SILU": 2})):
        ex2_e, rcp_e, n_e = forms(ptx(kernel, exact))
        ex2_f, rcp_f, n_f = forms(ptx(kernel, fast))
        assert (ex2_f, rcp_f) == (True, True), kernel
        assert (ex2_e, rcp_e) == (False, False), kernel
        assert n_e > 0 and n_f > 0, kernel
    print("ok")
    """
)


def test_norm_kernels_compile_the_fast_form_for_hopper():
    proc = subprocess.run([sys.executable, "-c", _HOPPER_PTX], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode == 77:
        pytest.skip(f"this Triton cannot compile for sm_90 here: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
