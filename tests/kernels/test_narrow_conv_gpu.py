"""narrow_conv (tap products + tap sum, Triton) at the decoder heads' real sizes on a GPU
(tier 3, ``cuda``), against its plain-torch twin (true fp32 convolution + bias, one rounding).
Small edge shapes under the interpreter are tier 1, in test_narrow_conv.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.narrow_conv import (
    narrow_conv,
    narrow_conv_reference,
    pack_narrow_conv_weight,
)
from support.conv_inputs import (  # noqa: F401 (true_fp32_oracle: an autouse fixture)
    check_edge_rows,
    conv_tensors,
    past_int32_input,
    true_fp32_oracle,
)

pytestmark = pytest.mark.cuda

CASES = [  # (input shape, Cout, kernel, padding)
    ((1, 128, 1024, 1024), 3, (3, 3), 1),  # SDXL / Flux head at 1024²
    ((4, 128, 384, 256), 3, (3, 3), 1),  # SD1.5 768x512 batch 4
    ((1, 96, 6, 480, 832), 3, (3, 3, 3), (0, 1, 1)),  # Wan 2.1 head, 4 frames after 2 cached
    ((1, 96, 1, 480, 832), 3, (1, 3, 3), (0, 1, 1)),  # its first chunk: one frame, last tap
    ((1, 256, 6, 352, 640), 12, (3, 3, 3), (0, 1, 1)),  # Wan 2.2 head (12 = 3 x 2x2 patches)
]



@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}")
def test_matches_reference_at_real_sizes(case):
    shape, cout, kernel, padding = case
    x, w, b = conv_tensors(shape, cout, kernel, device="cuda")
    y = narrow_conv(x, pack_narrow_conv_weight(w), padding, b)
    expected = narrow_conv_reference(x, w, b, padding)
    assert y is not None and y.shape == expected.shape
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-7)


PROLOGUE_CASES = [  # (input shape) of the KL heads the prologue serves: 128 -> 3, 3x3, padding 1
    (1, 128, 1024, 1024),  # SDXL / Flux 1024²
    (4, 128, 768, 512),  # SD1.5 768x512 batch 4: per-sample factors
    (1, 128, 2048, 2048),  # SDXL 2048²: 2^29 input elements, offsets past 2^31 bytes
]


@pytest.mark.parametrize("shape", PROLOGUE_CASES, ids=str)
def test_prologue_at_real_sizes(shape):
    # The fused head against the unfused one (the norm's activation written by the twin, then
    # narrow_conv): the same rounded activation, the products summed in the same tiles.
    from fast_vae_decode.kernels.group_norm_silu import NormSiLU
    from fast_vae_decode.kernels.narrow_conv import prologue_reference

    x, w, b = conv_tensors(shape, 3, (3, 3), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    n, c = shape[:2]
    prologue = NormSiLU((1 + 0.5 * torch.randn((n, c), generator=g, device="cuda")).contiguous(),
                        (0.5 * torch.randn((n, c), generator=g, device="cuda")).contiguous())
    packed = pack_narrow_conv_weight(w)
    fused = narrow_conv(x, packed, 1, b, prologue=prologue)
    activation = prologue_reference(x, prologue)
    unfused = narrow_conv(activation, packed, 1, b)
    assert fused is not None and fused.shape == unfused.shape
    # One bf16 step where torch and the kernel round an activation differently (FMA), rarely.
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2.0**-7, atol=2.0**-7)
    expected = narrow_conv_reference(activation, w, b, 1)
    torch.testing.assert_close(fused.float(), expected.float(), rtol=2.0**-6, atol=2.0**-6)


def test_prologue_input_past_int32_elements():
    # 2^31 + 2^20 input elements: pass 1's element offsets into x exceed int32 in the last
    # rows. The last and first 8 output rows against the twin on the rows they read.
    from fast_vae_decode.kernels.group_norm_silu import NormSiLU

    x = past_int32_input()
    g = torch.Generator(device="cuda").manual_seed(6)
    w = (torch.randn((3, 128, 3, 3), generator=g, device="cuda") / 34).bfloat16()
    b = (0.1 * torch.randn(3, generator=g, device="cuda")).bfloat16()
    prologue = NormSiLU((1 + 0.5 * torch.randn((1, 128), generator=g, device="cuda")).contiguous(),
                        (0.5 * torch.randn((1, 128), generator=g, device="cuda")).contiguous())
    y = narrow_conv(x, pack_narrow_conv_weight(w), 1, b, prologue=prologue)
    assert y is not None
    check_edge_rows(y, x, lambda rows: narrow_conv_reference(rows, w, b, 1, prologue=prologue),
                    2.0**-6)
