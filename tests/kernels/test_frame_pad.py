"""frame_pad (Triton: a causal conv's padded input in one pass) against its plain-torch twin.

Tier 1: the kernel under TRITON_INTERPRET on small shapes; pure copies, so the outputs must be
``torch.equal``. (Tier 3, offsets past int32 on a GPU, is in test_frame_pad_gpu.py.)
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels import frame_pad as fp

CL3D = torch.channels_last_3d


def _video(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=CL3D)


# (x shape, front frames or None, n_front without a front tensor, n_back, ph, pw) -- why each:
CASES = [
    ((1, 8, 4, 5, 6), 2, 0, 0, 1, 1),  # 0.33 chunk: two cached frames in front, reflect borders
    ((1, 8, 4, 5, 6), None, 2, 0, 1, 1),  # first chunk / 0.8: x's first frame repeated in front
    ((1, 8, 3, 4, 5), None, 1, 1, 1, 1),  # non-causal: one frame each side
    ((2, 24, 3, 5, 7), 2, 0, 0, 0, 0),  # zero padding (the conv pads): time only; C=24, batch 2
    ((1, 5, 1, 3, 3), None, 2, 0, 2, 2),  # one frame, reflect 2 on a 3x3 frame (widest allowed)
    ((1, 3, 2, 1, 4), None, 0, 0, 0, 1),  # a one-row frame: no row padding, columns reflected
]


@pytest.mark.parametrize("shape,front_frames,n_front,n_back,ph,pw", CASES)
def test_matches_the_twin_exactly(shape, front_frames, n_front, n_back, ph, pw):
    x = _video(shape)
    front = None
    if front_frames:
        front = _video(shape[:2] + (front_frames,) + shape[3:], seed=1)
    assert fp.frame_pad_unsupported(x, front, n_front, n_back, ph, pw) is None
    expected = fp.frame_pad_reference(x, front, n_front, n_back, ph, pw)
    out = fp.frame_pad(x, front, n_front, n_back, ph, pw)
    assert out.shape == expected.shape and out.is_contiguous(memory_format=CL3D)
    assert torch.equal(out, expected)


def test_reference_reflects_as_torch_pads():
    x = _video((1, 4, 3, 5, 6), dtype=torch.float32)
    expected = torch.nn.functional.pad(
        torch.cat([x[:, :, :1]] * 2 + [x], 2), (1, 1, 1, 1, 0, 0), mode="reflect")
    assert torch.equal(fp.frame_pad_reference(x, None, 2, 0, 1, 1), expected)


def test_a_time_slice_of_a_batch_is_read_by_its_strides():
    # A batch-2 slice along T: samples dense, the batch stride not (pixels_dense allows it).
    whole = _video((2, 8, 6, 4, 5))
    x = whole[:, :, 2:5]
    front = whole[:, :, :2]
    assert not x.is_contiguous(memory_format=CL3D)
    assert torch.equal(fp.frame_pad(x, front, 0, 0, 1, 1),
                       fp.frame_pad_reference(x, front, 0, 0, 1, 1))


@pytest.mark.parametrize("case,reason", [
    ("reflect too wide", "reflect padding"),  # stock raises there too (conv_frame_reason)
    ("front of another width", "front frames differ"),
    ("contiguous input", "not channels-last"),  # the caller converts first
])
def test_declines_what_it_cannot_take(case, reason):
    x = _video((1, 8, 3, 4, 5))
    front, ph = None, 1
    if case == "reflect too wide":
        ph = 4
    elif case == "front of another width":
        front = _video((1, 8, 2, 4, 6))
    else:
        x = x.contiguous()
    assert reason in fp.frame_pad_unsupported(x, front, 1, 0, ph, 1)


def test_declined_input_gets_the_twins_tensor():
    x = _video((1, 8, 3, 4, 5)).contiguous()
    out = fp.frame_pad(x, None, 2, 0, 1, 1)
    assert out.is_contiguous(memory_format=CL3D)
    assert torch.equal(out, fp.frame_pad_reference(x, None, 2, 0, 1, 1))
