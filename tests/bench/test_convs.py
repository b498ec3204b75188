"""The per-conv benchmark's shape collection, table and JSON (tier 1: meta device, no timing)."""
from __future__ import annotations

import json

import pytest

from fast_vae_decode.bench import convs
from fast_vae_decode.bench.cases import CASES
from fast_vae_decode.bench.cli import main

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def collected():
    return convs.collect_conv_shapes([CASES["sdxl-1024"], CASES["wan21-480p-33"]])


def _find(counts, **fields):
    return {s: n for s, n in counts.items()
            if all(getattr(s, k) == v for k, v in fields.items())}


def test_kl_shapes_as_the_fused_path_runs_them(collected):
    sdxl = collected["sdxl-1024"]
    # conv_in from the 4-channel latent, in the stock layout (cuDNN wants channels % 8)
    assert _find(sdxl, kind="conv_in") == {
        convs.ConvShape("conv_in", "conv2d-nchw", (1, 4, 128, 128), 512, (3, 3), (1, 1)): 1}
    # the head to 3 channels at full resolution
    assert _find(sdxl, kind="head") == {
        convs.ConvShape("head", "conv2d", (1, 128, 1024, 1024), 3, (3, 3), (1, 1)): 1}
    # three upsamples, each one folded 4x4 stride-2 transposed conv on the low-res input
    ups = _find(sdxl, kind="upsample")
    assert sorted(s.input for s in ups) == [(1, 256, 512, 512), (1, 512, 128, 128),
                                           (1, 512, 256, 256)]
    assert all(s.route == "transposed" and s.output[2] == 2 * s.input[2] for s in ups)
    # 2 + 3 * 4 resnet blocks of two 3x3 convs (plus conv_in, head, upsamples, shortcuts)
    assert sum(_find(sdxl, kind="3x3").values()) == 28
    assert sum(sdxl.values()) == 28 + 1 + 1 + 3 + 2


def test_wan_shapes_carry_the_cached_frames(collected):
    wan = collected["wan21-480p-33"]
    heads = _find(wan, kind="head")
    # 8 chunks of 4 new frames read 2 cached ones; the first chunk's single frame meets only
    # the last temporal tap. Narrow batch-1 convs run as 2-D taps.
    assert heads == {
        convs.ConvShape("head", "taps", (1, 96, 6, 480, 832), 3, (3, 3, 3), (0, 1, 1)): 8,
        convs.ConvShape("head", "taps", (1, 96, 1, 480, 832), 3, (1, 3, 3), (0, 1, 1)): 1}
    wide = _find(wan, kind="causal 3x3x3", input=(1, 384, 3, 60, 104))
    assert list(wide.values()) == [80] and next(iter(wide)).route == "conv3d"
    # The first chunk's single frames: 2-D from 128² pixels up to 384 channels, as the fused
    # path runs them (wan.ops.single_tap_2d_shape); smaller frames stay conv3d.
    first = _find(wan, kind="causal 3x3x3", input=(1, 384, 1, 120, 208))
    assert first and all(s.route == "taps" and s.kernel == (1, 3, 3) for s in first)
    small = _find(wan, kind="causal 3x3x3", input=(1, 384, 1, 60, 104))
    assert small and all(s.route == "conv3d" for s in small)
    full = _find(wan, kind="causal 3x3x3", input=(1, 96, 6, 480, 832))
    assert full and all(s.route == "taps" for s in full)
    time_convs = _find(wan, kind="time 3x1x1")
    assert all(s.kernel in ((3, 1, 1), (1, 1, 1)) for s in time_convs)
    # Chunk 1 skips both time convs; at the deepest level chunk 2 convolves its one frame
    # uncached (the last tap only), chunks 3-9 with a cache; one level up all 8 see 3 taps.
    assert sum(n for s, n in time_convs.items() if s.kernel == (3, 1, 1)) == 15
    assert sum(n for s, n in time_convs.items() if s.kernel == (1, 1, 1)) == 1


def test_wan_shapes_on_the_stacked_route_when_it_is_set(monkeypatch):
    """With ``stacked_taps`` set, cached chunks at the stacked shapes
    (wan.ops.STACKED_TAPS_MIN_PIXELS) are recorded as the one 2-D conv over the channel-stacked
    input; full resolution keeps its 2-D taps."""
    monkeypatch.setattr(convs.wan_settings, "stacked_taps", True)
    wan = convs.collect_conv_shapes([CASES["wan21-480p-33"]])["wan21-480p-33"]
    for shape in ((1, 384, 4, 120, 208), (1, 192, 4, 120, 208)):
        found = _find(wan, kind="causal 3x3x3", input=shape)
        assert found and all(s.route == "stacked" for s in found)
    full = _find(wan, kind="causal 3x3x3", input=(1, 96, 6, 480, 832))
    assert full and all(s.route == "taps" for s in full)


def test_flops_and_output():
    s = convs.ConvShape("3x3", "conv2d", (2, 8, 5, 7), 16, (3, 3), (1, 1))
    assert s.output == (2, 16, 5, 7) and s.flops == 2 * 8 * 16 * 9 * 35 * 2
    t = convs.ConvShape("upsample", "transposed", (1, 8, 5, 7), 4, (3, 3), (1, 1))
    assert t.output == (1, 4, 10, 14) and t.flops == 2 * 8 * 4 * 4 * 140
    c = convs.ConvShape("causal 3x3x3", "taps", (1, 8, 6, 5, 7), 8, (3, 3, 3), (0, 1, 1))
    assert c.output == (1, 8, 4, 5, 7)


def _results():
    a = convs.ConvShape("3x3", "conv2d", (1, 512, 128, 128), 512, (3, 3), (1, 1))
    b = convs.ConvShape("upsample", "transposed", (1, 512, 128, 128), 512, (3, 3), (1, 1))
    return [convs.ConvResult(a, {"x": 10, "y": 2}, cudnn_ms=0.2, triton_ms=0.25,
                             triton_config="128x128x64/w8/s3"),
            convs.ConvResult(b, {"x": 1}, cudnn_ms=0.3, note="no Triton route yet")]


def test_table_rows_and_totals():
    text = convs.convs_markdown(_results())
    lines = text.splitlines()
    assert "calls (x, y)" in lines[0]
    row = next(line for line in lines if line.startswith("| 3x3 "))
    assert "| 10, 2 |" in row and "| 0.200 |" in row and "0.80x" in row
    assert "no Triton route yet" in text
    # case x: 10 * 0.2 + 1 * 0.3 on cuDNN; best of both takes cuDNN's faster 3x3
    x = next(line for line in lines if line.startswith("| x |"))
    assert "| 2.30 |" in x and x.count("2.30") == 2


def test_json_round_trip(tmp_path):
    path = tmp_path / "convs.json"
    convs.write_json(str(path), _results(), {"gpu": "test"})
    env, back = convs.read_json(str(path))
    assert env == {"gpu": "test"}
    assert [r.shape for r in back] == [r.shape for r in _results()]
    assert back[0].triton_ms == 0.25 and back[0].calls == {"x": 10, "y": 2}
    assert json.loads(path.read_text())["convs"][0]["speedup"] == pytest.approx(0.8)


def test_cli_lists_shapes_without_a_gpu(tmp_path, capsys):
    path = tmp_path / "shapes.json"
    assert main(["convs", "--cases", "tiny-sdxl,tiny-wan21", "--shapes-only",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| head |" in out and "tiny-sdxl, tiny-wan21" in out
    _, results = convs.read_json(str(path))
    assert {r.shape.kind for r in results} >= {"conv_in", "head", "upsample", "3x3"}


def test_report_includes_the_conv_tables():
    from fast_vae_decode.bench.report import report_markdown

    text = report_markdown({}, [], {}, {}, ({"gpu": "H"}, _results()))
    assert "## Per-conv benchmark" in text and "| 3x3 | 1x512x128x128 |" in text


def test_recorded_conv_calls_in_order():
    """What ``recording_convs`` notes (the LTX-2 cases' source): each conv call's real input and
    padding, kinds from the order and shapes (first conv_in, last head, widening = upsample)."""
    import torch
    import torch.nn.functional as F

    x3 = torch.zeros(1, 4, 3, 5, 6)
    x2 = torch.zeros(1, 4, 5, 6)
    with convs.recording_convs() as shapes:
        F.conv3d(x3, torch.zeros(8, 4, 3, 3, 3))  # conv_in, whatever its widths
        F.conv3d(torch.zeros(1, 8, 3, 5, 6), torch.zeros(8, 8, 3, 3, 3), None, 1, 1)
        F.conv3d(torch.zeros(1, 8, 3, 5, 6), torch.zeros(32, 8, 3, 3, 3))  # before depth-to-space
        torch.conv2d(x2, torch.zeros(4, 4, 1, 1))
        F.conv_transpose2d(x2, torch.zeros(4, 4, 4, 4), None, stride=2, padding=1)
        F.conv2d(x2, torch.zeros(3, 4, 3, 3), padding="same")  # head (a chunk's)
        torch.conv2d(x2, torch.zeros(4, 4, 1, 1))
        F.conv2d(x2[..., :3], torch.zeros(3, 4, 3, 3), padding=1)  # the last chunk's head
        assert shapes == []  # filled on exit
    assert [(s.kind, s.route) for s in shapes] == [
        ("conv_in", "conv3d"), ("causal 3x3x3", "conv3d"), ("upsample", "conv3d"),
        ("1x1", "conv2d"), ("upsample", "transposed"), ("head", "conv2d"), ("1x1", "conv2d"),
        ("head", "conv2d")]
    assert shapes[7].input == (1, 4, 5, 3)
    assert shapes[0] == convs.ConvShape("conv_in", "conv3d", (1, 4, 3, 5, 6), 8, (3, 3, 3), (0, 0, 0))
    assert shapes[1].padding == (1, 1, 1) and shapes[1].output == (1, 8, 3, 5, 6)
    assert shapes[4].input == (1, 4, 5, 6) and shapes[4].cout == 4  # the low-res input, as folded
    assert shapes[5].padding == (1, 1)


def test_ltx_cases_need_comfyui(capsys):
    """LTX-2's convs come only from ComfyUI's own model: without a tree, a clear error."""
    with pytest.raises(ValueError, match="--comfyui"):
        convs.collect_conv_shapes([CASES["ltx2-768x512-121"]])
    assert main(["convs", "--cases", "ltx2-768x512-121", "--shapes-only"]) == 2
    assert "--comfyui PATH" in capsys.readouterr().err


# --- convs --cudnn-graph (bench/cudnn_graph.py: optional nvidia-cudnn-frontend) ----------------


def _graph_results():
    results = _results()
    results[0].cudnn_graph = {"pass_ms": 0.2, "stats_pass_ms": 0.21, "conv_ms": 0.1,
                              "epilogue_ms": 0.15, "plans": {"conv": "eng62", "epilogue": "eng4"},
                              "max_error": {"epilogue": 3e-3},
                              "unsupported": {"prologue": "cudnnGraphNotSupportedError: no engine"}}
    return results


def test_graphs_apply_to_the_2d_convs_on_cudnn_only():
    from fast_vae_decode.bench import cudnn_graph

    wan = convs.ConvShape("causal 3x3x3", "taps", (1, 96, 6, 48, 80), 96, (3, 3, 3), (0, 1, 1))
    results = _results() + [convs.ConvResult(wan, {"x": 1})]
    assert [r.shape.kind for r in cudnn_graph.graph_shapes(results)] == ["3x3"]


def test_graph_table_compares_each_graph_with_the_conv_and_pass():
    from fast_vae_decode.bench import cudnn_graph

    text = cudnn_graph.graph_markdown(_graph_results())
    row = next(line for line in text.splitlines() if line.startswith("| 1x512x128x128 "))
    assert "| 0.200 | 0.210 | 0.100 | 0.150 (-25%) |" in row  # 0.15 against 0.2
    assert "| — | unsupported | eng62; eng4 |" in row  # no genstats timed; prologue declined
    assert len(text.splitlines()) == 3  # the transposed conv has no graph row


def test_graph_results_survive_the_json(tmp_path):
    path = tmp_path / "convs.json"
    convs.write_json(str(path), _graph_results(), {})
    _, back = convs.read_json(str(path))
    assert back[0].cudnn_graph["epilogue_ms"] == 0.15 and back[1].cudnn_graph == {}


def test_cudnn_graph_refuses_what_it_cannot_time_in_one_line(monkeypatch, capsys):
    import sys

    assert main(["convs", "--cases", "tiny-sdxl", "--shapes-only", "--cudnn-graph"]) == 2
    assert "--cudnn-graph: --shapes-only times nothing" in capsys.readouterr().err
    # A GPU but no frontend: said before any shape is collected, with how to get it.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    assert main(["convs", "--cases", "tiny-sdxl", "--cudnn-graph"]) == 2
    err = capsys.readouterr().err
    assert "needs nvidia-cudnn-frontend" in err and "pip install nvidia-cudnn-frontend" in err
    assert len(err.strip().splitlines()) == 1


def test_report_shows_the_graph_table_only_when_the_run_made_one():
    from fast_vae_decode.bench.report import convs_section

    assert not any("cuDNN's graph API" in line for line in convs_section({}, _results()))
    assert any("cuDNN's graph API" in line for line in convs_section({}, _graph_results()))


def test_winograd_variant_only_for_2d_3x3_pad_1():
    """winograd_conv joins the timed variants of the 2-D 3x3 convs it computes, and its call
    is that conv (with the bias), under the interpreter."""
    import torch
    import torch.nn.functional as F

    s = convs.ConvShape("3x3", "conv2d", (1, 8, 5, 7), 8, (3, 3), (1, 1))
    chosen = [v for v in convs.variants(s, sweep=True) if v.op == "winograd_conv"]
    assert len(chosen) == 3 and str(chosen[0]).startswith("winograd_conv in 4x64/w4 out")
    for other in (convs.ConvShape("1x1", "conv2d", (1, 8, 5, 7), 8, (1, 1), (0, 0)),
                  convs.ConvShape("conv_in", "conv2d-nchw", (1, 4, 5, 7), 8, (3, 3), (1, 1)),
                  convs.ConvShape("causal 3x3x3", "conv3d", (1, 8, 3, 5, 7), 8, (3, 3, 3), (0, 1, 1))):
        assert all(v.op != "winograd_conv" for v in convs.variants(other, sweep=True))
    x, w, b = convs._inputs(s, "cpu", torch.bfloat16)
    y = convs.variant_call(chosen[0], s, x, w, b, {})()
    expected = F.conv2d(x.float(), w.float(), b.float(), padding=1)
    assert (y.float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_padded_grid_variant_where_the_dsl_runs_and_a_tiling_is_measured(monkeypatch):
    """With the DSL reported available, padded_grid_conv joins the variants of Wan 2.1's
    3x3x3 widths, not of others; its call (the kernel stood in for by its GEMM twin, on the
    CPU) is the conv with the bias."""
    import torch
    import torch.nn.functional as F

    from fast_vae_decode.kernels import padded_grid_conv as pgc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pgc, "dsl_unavailable_reason", lambda device=None: None)
    tilings = []

    def twin(padded, packed, bias=None, residual=None, tiling=None):
        tilings.append(tiling)
        return pgc.padded_grid_gemm_reference(padded, packed, bias, residual)

    monkeypatch.setattr(pgc, "padded_grid_conv", twin)
    s = convs.ConvShape("causal 3x3x3", "taps", (1, 96, 3, 4, 5), 96, (3, 3, 3), (0, 1, 1))
    chosen = [v for v in convs.variants(s, sweep=False) if v.op == "padded_grid_conv"]
    assert [c.config for c in chosen] == [pgc.TILINGS[(96, 96, 3)]]
    for other in (convs.ConvShape("causal 3x3x3", "conv3d", (1, 64, 3, 4, 5), 64, (3, 3, 3), (0, 1, 1)),
                  convs.ConvShape("3x3", "conv2d", (1, 96, 4, 5), 96, (3, 3), (1, 1))):
        assert all(v.op != "padded_grid_conv" for v in convs.variants(other, sweep=True))
    x, w, b = convs._inputs(s, "cpu", torch.bfloat16)
    y = convs.variant_call(chosen[0], s, x, w, b, {})()
    expected = F.conv3d(x.float(), w.float(), b.float(), padding=(0, 1, 1))
    assert (y.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    assert tilings == [pgc.TILINGS[(96, 96, 3)]]


def test_padded_grid_sweep_times_the_candidate_tilings_and_the_kl_convs(monkeypatch):
    """The sweep adds ``SWEEP_TILINGS``' candidates after the shape's own tiling, each call run
    at its tiling; a KL decoder's 2-D 3x3 conv of a measured width joins too, its batch's
    images the grid's frames (as the KL route runs it), and its call is the 2-D conv."""
    import torch
    import torch.nn.functional as F

    from fast_vae_decode.kernels import padded_grid_conv as pgc

    tilings = []

    def twin(padded, packed, bias=None, residual=None, tiling=None):
        tilings.append(tiling)
        return pgc.padded_grid_gemm_reference(padded, packed, bias, residual)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pgc, "dsl_unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(pgc, "padded_grid_conv", twin)
    wan = convs.ConvShape("causal 3x3x3", "taps", (1, 96, 3, 4, 5), 96, (3, 3, 3), (0, 1, 1))
    swept = [v.config for v in convs.variants(wan, sweep=True) if v.op == "padded_grid_conv"]
    assert swept == [pgc.TILINGS[(96, 96, 3)], *pgc.SWEEP_TILINGS[(96, 96, 3)]]
    kl = convs.ConvShape("3x3", "conv2d", (2, 128, 5, 7), 128, (3, 3), (1, 1))
    chosen = [v for v in convs.variants(kl, sweep=True) if v.op == "padded_grid_conv"]
    assert [v.config for v in chosen] == [pgc.TILINGS[(128, 128, 1)],
                                          *pgc.SWEEP_TILINGS[(128, 128, 1)]]
    x, w, b = convs._inputs(kl, "cpu", torch.bfloat16)
    packs = {}
    y = convs.variant_call(chosen[-1], kl, x, w, b, packs)()
    expected = F.conv2d(x.float(), w.float(), b.float(), padding=1)
    got = y[0].transpose(0, 1)  # (1, Cout, N, H, W) -> (N, Cout, H, W)
    assert got.shape == expected.shape
    assert (got.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    assert tilings == [pgc.SWEEP_TILINGS[(128, 128, 1)][0]]
    only = convs.chosen_variants(kl, True, ("padded_grid_conv",))
    assert only == chosen and len(convs.variants(kl, sweep=True)) > len(only)
    # a KL conv outside the measured widths, or not the resnet's padding-1 3x3, stays out
    for other in (convs.ConvShape("3x3", "conv2d", (2, 64, 5, 7), 64, (3, 3), (1, 1)),
                  convs.ConvShape("conv_in", "conv2d-nchw", (1, 128, 5, 7), 128, (3, 3), (1, 1))):
        assert all(v.op != "padded_grid_conv" for v in convs.variants(other, sweep=True))
