"""implicit_gemm_conv (Triton) at the decoders' real sizes on a GPU (tier 3, ``cuda``).

Against its plain-torch twin (fp32 convolution, fp32 bias and residual, one rounding): the
KL decoder's 512-channel 3x3 with its residual, the Wan decoder's full-resolution 96-channel
causal 3x3x3 on an assembled buffer and its 96->3 head, the SDXL 128->3 head and 4-channel
conv_in, and an input past 2^31 elements (int64 pixel offsets), checked where an int32 offset
would have wrapped. Small edge shapes under the interpreter are tier 1, in
test_implicit_gemm_conv.py.
"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.kernels.implicit_gemm_conv import (
    implicit_gemm_conv,
    implicit_gemm_conv_reference,
    pack_conv_weight,
)
from support.conv_inputs import (  # noqa: F401 (true_fp32_oracle: an autouse fixture)
    check_edge_rows,
    conv_tensors,
    past_int32_input,
    true_fp32_oracle,
)

pytestmark = pytest.mark.cuda


CASES = [  # (input shape, Cout, kernel, padding, residual)
    ((1, 512, 128, 128), 512, (3, 3), 1, True),  # SDXL mid/up block conv2 + shortcut
    ((1, 4, 128, 128), 512, (3, 3), 1, False),  # SDXL conv_in
    ((1, 128, 1024, 1024), 3, (3, 3), 1, False),  # SDXL head
    ((4, 256, 96, 64), 256, (3, 3), 1, False),  # SD1.5 batch 4
    ((1, 96, 6, 480, 832), 96, (3, 3, 3), (0, 1, 1), True),  # Wan 2.1 full resolution
    ((1, 96, 6, 480, 832), 3, (3, 3, 3), (0, 1, 1), False),  # Wan 2.1 head
    ((1, 384, 4, 120, 208), 384, (3, 1, 1), 0, False),  # time_conv-like, temporal only
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}")
def test_matches_reference_at_real_sizes(case):
    shape, cout, kernel, padding, residual = case
    x, w, b = conv_tensors(shape, cout, kernel, device="cuda")
    expected = implicit_gemm_conv_reference(x, w, b, padding)
    res = None
    if residual:
        res = torch.randn_like(expected)
        expected = implicit_gemm_conv_reference(x, w, b, padding, res)
    y = implicit_gemm_conv(x, pack_conv_weight(w), padding, b, res)
    assert y is not None and y.shape == expected.shape
    # fp32 accumulation in another order, one rounding each: about one bf16 ULP.
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-7)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] % 8 == 0 and c[0][1] % 8 == 0],
                         ids=lambda c: f"{c[0]}->{c[1]}")
def test_tma_variant_at_real_sizes(case):
    from fast_vae_decode.kernels.implicit_gemm_conv import ConvConfig, tma_reason

    shape, cout, kernel, padding, residual = case
    x, w, b = conv_tensors(shape, cout, kernel, device="cuda")
    expected = implicit_gemm_conv_reference(x, w, b, padding)
    res = torch.randn_like(expected) if residual else None
    if residual:
        expected = implicit_gemm_conv_reference(x, w, b, padding, res)
    cfg = ConvConfig(128, 128, 64, 8, 3, tma=True)
    packed = pack_conv_weight(w)
    assert tma_reason(x, packed, padding, x.dtype, res, cfg) is None
    y = implicit_gemm_conv(x, packed, padding, b, res, cfg)
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=2.0**-7)


def test_input_past_int32_elements():
    # 2^31 + 2^20 elements: the last rows' pixel offsets exceed int32.
    x = past_int32_input()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn((16, 128, 3, 3), generator=g, device="cuda") / 34).bfloat16()
    y = implicit_gemm_conv(x, pack_conv_weight(w), 1)
    assert y is not None
    # The last 8 rows (beyond 2^31 elements) against the oracle on the rows they read.
    check_edge_rows(y, x, lambda rows: implicit_gemm_conv_reference(rows, w, None, 1), 2.0**-7)
