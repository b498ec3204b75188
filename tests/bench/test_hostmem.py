"""bench/hostmem.py: with ``steady``, memory freed by a decode stays in the process.

The bench's default host condition (see the module docstring): ComfyUI's CPU-side tail of a
1024x1024 decode frees ~50 MB per call, which glibc by default hands back to the OS, so the next
call page-faults it in again (12,256 faults per call were counted on the H200 host). Whether
freed memory is returned is checked directly, in fresh processes without torch (whose import
already moves glibc's adaptive thresholds): a 24 MiB block, written and freed, goes back to the
OS with glibc's defaults and stays with ``steady``. No timing.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import ctypes, ctypes.util, importlib.util, sys
spec = importlib.util.spec_from_file_location("hostmem", sys.argv[2])
hostmem = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hostmem)
if sys.argv[1] == "steady":
    assert hostmem.keep_freed_host_memory().startswith("steady")
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def held():  # heap arena plus mmapped blocks: what the process holds from the OS
    info = libc.mallinfo2()
    return info.arena + info.hblkhd
size = 24 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
before = held()
libc.free(block)
print((before - held()) >> 20)  # MiB handed back to the OS by the free
"""


def _returned_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(ROOT / "bench" / "hostmem.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    import ctypes
    import ctypes.util

    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(),
                    reason="needs glibc >= 2.33 (mallopt, mallinfo2)")
def test_steady_host_malloc_keeps_freed_memory():
    assert _returned_mib("system") >= 20  # glibc's default: a block this size is unmapped on free
    assert _returned_mib("steady") == 0
