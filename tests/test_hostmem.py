"""bench/hostmem.py: with ``steady``, decode-sized CPU tensors stop page-faulting per call.

The bench's default host condition (see the module docstring). Measured by minor page faults
in a fresh process (a long-lived one, like this test run, has a fragmented heap that already
hides the effect), never by time: ComfyUI's CPU-side tail of a 1024x1024 decode faults ~12,000
pages in on every call with glibc's defaults, and none once freed memory is kept.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBE = r"""
import resource, sys
sys.path.insert(0, sys.argv[2])
import conftest  # noqa: maps the checkout as fast_vae_decode
import torch
from fast_vae_decode.bench.hostmem import keep_freed_host_memory
if sys.argv[1] == "steady":
    assert keep_freed_host_memory().startswith("steady")
src = torch.randn(1, 3, 1024, 1024).to(torch.bfloat16)
def tail():  # what comfy.sd.VAE.decode does on the CPU after the decoder
    images = torch.clamp((src.float() + 1.0) / 2.0, min=0.0, max=1.0)
    out = torch.empty_like(images)
    out.copy_(images)
counts = []
for i in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tail()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(counts[3:]))
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(ROOT / "tests")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_steady_host_malloc_stops_per_call_page_faults():
    system = _faults("system")
    if system < 2000:
        pytest.skip(f"this libc keeps freed memory by itself ({system} faults per call)")
    assert _faults("steady") < 300, f"system: {system} faults per call"
