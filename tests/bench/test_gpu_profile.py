"""``profile``'s trace analysis (``bench/gpu_profile.py``) on synthetic Chrome traces, and the
command's refusal without a GPU. (It profiles real decodes only on a GPU, by hand.)"""
from __future__ import annotations

import pytest
import torch

from fast_vae_decode.bench import gpu_profile
from fast_vae_decode.bench.cli import main


def _op(name, ts, dur, corr, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts, corr, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def _trace():
    # GPU: [0,10) conv; [5,12) a copy on another stream (overlaps); gap [12,20) before a Triton
    # kernel launched at 15 by a driver call (host-late); [20,30) it; gap [30,90) before a
    # kernel launched at 2 (queued: issued long before the GPU got to it); [90,100) it.
    return {"traceEvents": [
        _op("sm90_xmma_fprop_implicit_gemm_bf16", 0, 10, 1),
        _op("Memcpy DtoD (Device -> Device)", 5, 7, 2, cat="gpu_memcpy"),
        _op("_rms_norm_silu_kernel", 20, 10, 3),
        _op("void at::native::vectorized_elementwise_kernel<add>", 90, 10, 4),
        _launch(0, 1), _launch(1, 2), _launch(15, 3, cat="cuda_driver"), _launch(2, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "ts": 0, "dur": 3, "args": {}},
    ]}


def test_busy_is_the_union_of_streams_and_idle_gaps_are_classed_by_their_launch():
    s = gpu_profile.analyse_trace(_trace())
    assert s.span_ms == pytest.approx(0.100)
    assert s.busy_ms == pytest.approx(0.012 + 0.010 + 0.010)  # [0,12) once, not 10 + 7
    assert s.idle_ms == pytest.approx(0.068)
    assert s.host_late_ms == pytest.approx(0.008) and s.queued_ms == pytest.approx(0.060)
    assert s.gap_count == 2
    first, second = sorted(s.largest_gaps, key=lambda g: g.start_us)
    assert (first.late, first.before) == (True, "_rms_norm_silu_kernel")  # Triton: a driver call
    assert second.late is False and s.largest_gaps[0] is second  # largest first


def test_idle_is_placed_in_the_tenth_of_the_span_where_its_gap_starts():
    tenths = gpu_profile.analyse_trace(_trace()).idle_by_tenth_ms
    assert len(tenths) == 10 and sum(tenths) == pytest.approx(0.068)
    assert tenths[1] == pytest.approx(0.008) and tenths[3] == pytest.approx(0.060)


def test_kernels_are_summed_by_kind_and_listed_largest_first():
    s = gpu_profile.analyse_trace(_trace(), top=2)
    assert s.kinds["conv / matmul"] == (pytest.approx(0.010), 1)
    assert s.kinds["copy"] == (pytest.approx(0.007), 1)
    assert s.kinds["triton"] == (pytest.approx(0.010), 1)
    assert s.kinds["elementwise / other"] == (pytest.approx(0.010), 1)
    assert len(s.top) == 2 and s.top[0][1] >= s.top[1][1]


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "conv / matmul"),
    ("sm90_xmma_dgrad_implicit_gemm_indexed_bf16", "conv / matmul"),  # the folded upsample
    ("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "conv / matmul"),  # cuBLAS
    ("_group_norm_stats_kernel", "triton"),
    ("fmha_cutlassF_bf16_aligned_32x128_gmem_sm80", "attention"),
    ("Memset (Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, silu_kernel>", "elementwise / other"),
])
def test_kind_of_names_the_libraries_kernels(name, kind):
    assert gpu_profile.kind_of(name) == kind


def test_a_trace_without_gpu_work_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        gpu_profile.analyse_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0,
                                                    "dur": 1, "name": "aten::add"}]})


def test_the_markdown_has_the_totals_and_every_section():
    s = gpu_profile.analyse_trace(_trace())
    text = gpu_profile.summary_markdown("tiny (high)", [1.0, 1.5], 2.0, s)
    assert "| 0.1 | 0.0 | 0.1 | 0.0 | 0.1 | 2 |" in text
    assert "idle by tenth of the span" in text and "| kind | ms | ops |" in text
    assert "| largest gaps, ms | class | before |" in text and "host-late" in text


def test_a_decode_the_profiler_slowed_says_its_host_late_idle_is_overstated():
    s = gpu_profile.analyse_trace(_trace())
    slowed = gpu_profile.summary_markdown("tiny (high)", [1.0, 1.5, 1.2], 2.0, s)
    assert "took 1.67x the unprofiled median" in slowed and "--timeline" in slowed
    for walls in ([1.9, 2.0, 2.1], []):  # within 10% of the median, or no unprofiled decode
        assert "unprofiled median" not in gpu_profile.summary_markdown("tiny", walls, 2.0, s)


def test_profile_without_a_gpu_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["profile", "--no-comfyui", "--cases", "tiny-sdxl"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" in err


def test_host_calls_are_summed_by_name_and_split_at_the_first_tenth():
    trace = _trace()
    # A cudaMalloc late in the decode (after the first tenth, which ends at ts 10).
    trace["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMalloc",
                                 "ts": 50, "dur": 40, "args": {}})
    s = gpu_profile.analyse_trace(trace)
    runtime = {name: rest for name, *rest in s.runtime_calls}
    assert runtime["cudaMalloc"] == [1, pytest.approx(0.040), 0, 0.0]
    # four launches (the synthetic driver call carries the same name): those at ts 0, 1 and 2
    # begin in the first tenth, the one at 15 does not
    assert runtime["cudaLaunchKernel"] == [4, pytest.approx(0.004), 3, pytest.approx(0.003)]
    assert s.runtime_calls[0][0] == "cudaMalloc"  # most time first
    assert s.cpu_ops == [("aten::conv2d", 1, pytest.approx(0.003), 1, pytest.approx(0.003))]
    text = gpu_profile.summary_markdown("tiny (high)", [1.0], 2.0, s)
    assert "| `cudaMalloc` | 1 | 0.04 | 0 | 0.00 |" in text and "host CPU ops" in text
