"""``convs --gemm-bound``: each conv's own M x N x K, its table, JSON and report section
(tier 1: no timing; the timing itself runs on the GPU machine only)."""
from __future__ import annotations

import pytest

from fast_vae_decode.bench import convs, gemm_bound
from fast_vae_decode.bench.cli import main


def _shapes():
    return [
        convs.ConvShape("3x3", "conv2d", (1, 512, 128, 128), 512, (3, 3), (1, 1)),
        convs.ConvShape("upsample", "transposed", (1, 512, 128, 128), 512, (3, 3), (1, 1)),
        convs.ConvShape("causal 3x3x3", "taps", (1, 96, 6, 48, 80), 96, (3, 3, 3), (0, 1, 1)),
        convs.ConvShape("head", "conv2d", (2, 128, 64, 64), 3, (3, 3), (1, 1)),
        convs.ConvShape("1x1", "conv3d", (1, 192, 2, 12, 20), 384, (1, 1, 1), (0, 0, 0)),
    ]


@pytest.mark.parametrize("shape", _shapes(), ids=lambda s: s.kind)
def test_the_product_is_the_one_the_conv_computes(shape):
    """Every route's M x N x K has the conv's own FLOPs (the folded upsample: 4 taps per
    output pixel; a 3-D conv: its output frames count in M, its taps in K)."""
    m, n, k = gemm_bound.gemm_dims(shape)
    assert 2 * m * n * k == shape.flops
    assert n == shape.cout and m == shape.output[0] * shape.output[2] * shape.output[3] * (
        shape.output[4] if len(shape.output) == 5 else 1)


def _results():
    a, b, *_ = _shapes()
    head = _shapes()[3]
    return [convs.ConvResult(a, {"x": 10, "y": 2}, cudnn_ms=0.2, gemm_ms=0.1),
            convs.ConvResult(b, {"x": 1}, cudnn_ms=0.3, gemm_note="M x K operand over 16 GiB"),
            convs.ConvResult(head, {"y": 1}, cudnn_ms=0.4, gemm_ms=0.5)]


def test_table_rows_and_per_case_sums():
    text = gemm_bound.gemm_markdown(_results())
    row = next(line for line in text.splitlines() if line.startswith("| 3x3 "))
    assert "| 16384x512x4608 |" in row and "| 2.00x |" in row
    assert "M x K operand over 16 GiB" in text
    lines = text.splitlines()
    # case x: cuDNN 10 * 0.2 + 0.3; the untimed upsample counts cuDNN's time.
    x = next(line for line in lines if line.startswith("| x |"))
    assert "| 2.30 | 1.30 | 1.00 |" in x
    # case y: the head's GEMM is slower than its conv (memory-bound): cuDNN's time counts.
    y = next(line for line in lines if line.startswith("| y |"))
    assert "| 0.80 | 0.60 | 0.20 |" in y


def test_gemm_results_survive_the_json(tmp_path):
    path = tmp_path / "convs.json"
    convs.write_json(str(path), _results(), {})
    _, back = convs.read_json(str(path))
    assert [(r.gemm_ms, r.gemm_note) for r in back] == [
        (0.1, None), (None, "M x K operand over 16 GiB"), (0.5, None)]


def test_report_shows_the_gemm_table_only_when_the_run_made_one():
    from fast_vae_decode.bench.report import convs_section

    plain = [convs.ConvResult(s, {"x": 1}, cudnn_ms=0.2) for s in _shapes()[:2]]
    assert not any("cuBLAS" in line for line in convs_section({}, plain))
    assert any("cuBLAS" in line for line in convs_section({}, _results()))


def test_gemm_bound_refuses_shapes_only_in_one_line(capsys):
    assert main(["convs", "--cases", "tiny-sdxl", "--shapes-only", "--gemm-bound"]) == 2
    err = capsys.readouterr().err
    assert "--gemm-bound: --shapes-only times nothing" in err and len(err.strip().splitlines()) == 1


@pytest.mark.cuda
def test_on_the_gpu_each_timed_conv_gets_its_gemm_or_a_reason(monkeypatch):
    # The limit at the 3x3's own M x K operand (16384 x 4608 bf16): it is timed, while the
    # folded upsample's (65536 x 2048) is over the limit.
    small, large = _shapes()[0], _shapes()[1]
    monkeypatch.setattr(gemm_bound, "MAX_OPERAND_BYTES", 2 * 16384 * 4608)
    results = [convs.ConvResult(small, {"x": 1}, cudnn_ms=1.0),
               convs.ConvResult(large, {"x": 1}, cudnn_ms=1.0),
               convs.ConvResult(small, {"x": 1})]  # cuDNN untimed: nothing to compare
    gemm_bound.time_gemms(results, repeats=1, warmup=0, log=lambda line: None)
    assert results[0].gemm_ms is not None and results[0].gemm_note is None
    assert results[1].gemm_ms is None and "GiB limit" in results[1].gemm_note
    assert results[2].gemm_ms is None and results[2].gemm_note is None
