"""direct_launch: the signature that decides when a kept compiled kernel is reused, and the
argument list its launcher gets.

Tier 1 with stand-in kernels (no GPU: what is tested is the keying and the hand-off, not
Triton). Tier 3, real kernels launched both ways with bit-identical results, is in
test_direct_launch_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import direct_launch as dl

pytestmark = pytest.mark.skipif(dl.triton is None, reason=dl.direct_launch_unavailable_reason() or "")


def _key(*args, **kwargs):
    return dl.launch_key("k", 0, args, kwargs)


def test_launches_that_triton_could_compile_apart_get_different_keys():
    x = torch.zeros(64, dtype=torch.bfloat16)
    base = _key(x, 17, 2.0, BLOCK=64, num_warps=4)
    differing = [
        _key(x.float(), 17, 2.0, BLOCK=64, num_warps=4),  # dtype
        _key(x[1:], 17, 2.0, BLOCK=64, num_warps=4),  # pointer 2 bytes off 16-byte alignment
        _key(x, 1, 2.0, BLOCK=64, num_warps=4),  # == 1 is specialised
        _key(x, 32, 2.0, BLOCK=64, num_warps=4),  # divisible by 16 is specialised
        _key(x, 2 ** 31 + 1, 2.0, BLOCK=64, num_warps=4),  # i64 instead of i32
        _key(x, 17, 2.0, BLOCK=128, num_warps=4),  # constexpr value
        _key(x, 17, 2.0, BLOCK=64, num_warps=8),  # compile option
        _key(x, 17, None, BLOCK=64, num_warps=4),  # None is a constexpr
        _key(x, 17, 2.0, BLOCK=64.0, num_warps=4),  # a float constexpr equal to the int
        dl.launch_key("k", 1, (x, 17, 2.0), dict(BLOCK=64, num_warps=4)),  # device
        dl.launch_key("other", 0, (x, 17, 2.0), dict(BLOCK=64, num_warps=4)),  # kernel
    ]
    assert all(k != base for k in differing)
    assert len(set(differing)) == len(differing)


def test_launches_that_differ_only_in_values_share_a_key():
    # Other data, other (unspecialised) sizes, another float: one compiled kernel serves both.
    a = torch.zeros(64, dtype=torch.bfloat16)
    b = torch.ones(128, dtype=torch.bfloat16)
    assert _key(a, 17, 2.0, BLOCK=64) == _key(b, 33, -1.5, BLOCK=64)
    assert _key(True) != _key(False)  # bools are kept apart by value, to be safe


@pytest.mark.parametrize("odd", ["text", [1, 2], (1,), torch.float32])
def test_arguments_of_other_types_are_not_keyed(odd):
    with pytest.raises(dl._Unkeyable):
        _key(odd)


def test_a_tensor_keyword_is_not_keyed():
    # Keyed by identity it would never hit again, and the kept tail would hold the tensor.
    with pytest.raises(dl._Unkeyable):
        _key(torch.zeros(1), bias_ptr=torch.zeros(1))


def test_an_unhashable_keyword_is_not_keyed():
    with pytest.raises(TypeError):
        hash(_key(torch.zeros(1), CONFIG=[1, 2]))


def test_a_launch_that_cannot_be_keyed_is_left_to_triton(monkeypatch):
    monkeypatch.setattr(dl, "_current_device", lambda: 0)
    assert not dl.launch_direct(_Kernel(), (1,), (torch.zeros(1),), {"CONFIG": [1, 2]})
    assert not dl.launch_direct(_Kernel(), (1,), ("text",), {})


def _probe(x_ptr, n, scale, BLOCK, FLAG=True):
    pass


# A JITFunction even where the tests run under the interpreter (whose stand-in lacks ``params``).
_probe_kernel = dl.triton.runtime.jit.JITFunction(_probe) if dl.triton is not None else None


def test_the_tail_is_every_later_parameter_in_signature_order():
    x = torch.zeros(4)
    assert dl.signature_tail(_probe_kernel, (x, 4, 1.0), {"BLOCK": 8, "num_warps": 4}) == (8, True)
    assert dl.signature_tail(_probe_kernel, (x, 4, 1.0), {"FLAG": False, "BLOCK": 8}) == (8, False)
    assert dl.signature_tail(_probe_kernel, (x, 4), {"scale": 1.0, "BLOCK": 8}) == (1.0, 8, True)
    assert dl.signature_tail(_probe_kernel, (x, 4, 1.0), {}) is None  # BLOCK missing
    assert dl.signature_tail(_probe_kernel, (x, 4, 1.0), {"n": 3, "BLOCK": 8}) is None  # twice


class _Compiled:
    """Stands in for Triton's CompiledKernel: its launcher records what it was handed."""

    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = "function", "packed"

    def run(self, *handed):
        self.calls.append(handed)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` is Triton's own dispatch."""

    arg_names = ["x_ptr", "n", "BLOCK"]
    params = None

    def __init__(self):
        self.compiled = _Compiled()
        self.dispatched = 0

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatched += 1
            return self.compiled
        return dispatch


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(dl, "_current_device", lambda: 0)
    monkeypatch.setattr(dl, "_stream_getter", lambda: (lambda device: 1234))
    dl.forget_compiled_launches()
    yield
    dl.forget_compiled_launches()


def test_the_second_launch_goes_straight_to_the_compiled_kernel(fresh):
    kernel, x = _Kernel(), torch.zeros(8)
    assert dl.launch_direct(kernel, (3,), (x, 8), {"BLOCK": 16, "num_warps": 4})
    assert kernel.dispatched == 1 and kernel.compiled.calls == []
    y = torch.ones(8)
    assert dl.launch_direct(kernel, (5, 2), (y, 9), {"BLOCK": 16, "num_warps": 4})
    assert kernel.dispatched == 1
    (handed,) = kernel.compiled.calls
    # grid padded to three, the stream, the handles, metadata and hooks, then every parameter
    assert handed[:7] == (5, 2, 1, 1234, "function", "packed", ("metadata", (5, 2)))
    assert handed[9] is y and handed[10:] == (9, 16)


def test_switched_off_or_hooked_launches_take_tritons_dispatch(fresh, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(8)
    monkeypatch.setattr(dl.launch_settings, "direct", False)
    assert not dl.launch_direct(kernel, (1,), (x, 8), {"BLOCK": 16})
    monkeypatch.setattr(dl.launch_settings, "direct", True)
    assert not dl.launch_direct(kernel, lambda meta: (1,), (x, 8), {"BLOCK": 16})  # callable grid
    monkeypatch.setattr(dl, "_hooks_set", lambda: True)  # a profiler's launch hook
    for _ in range(3):
        assert dl.launch_direct(kernel, (1,), (x, 8), {"BLOCK": 16})
    assert kernel.dispatched == 3 and kernel.compiled.calls == []


class _Chain:
    def __init__(self, calls):
        self.calls = calls


def test_a_launch_hook_counts_as_set_only_when_it_would_run():
    assert not dl._hook_active(None)
    assert not dl._hook_active(_Chain([]))  # newer Tritons: an empty HookChain
    assert dl._hook_active(_Chain([print]))
    assert dl._hook_active(print)  # older ones: the callable itself


def test_the_kept_kernels_stay_bounded(fresh, monkeypatch):
    monkeypatch.setattr(dl, "MAX_KERNELS", 3)
    kernel = _Kernel()
    for block in range(10):
        dl.launch_direct(kernel, (1,), (torch.zeros(4), 4), {"BLOCK": block})
    assert len(dl._KERNELS) <= 3


def test_a_kernel_made_under_the_interpreter_is_left_to_triton():
    def body(x_ptr, BLOCK):
        pass

    interpreted = dl._Interpreted(body)
    assert not dl.launch_direct(interpreted, (1,), (torch.zeros(1),), {"BLOCK": 4})
