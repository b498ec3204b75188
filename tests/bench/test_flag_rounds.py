"""``modes``: high under ComfyUI's default flags against other flags, in alternating bench
processes (``bench.flag_rounds``). Tier 1: the bench processes are stand-ins that write the
JSON a real one would; the rounds, their order and the comparison are what is tested."""
from __future__ import annotations

import json
import pathlib

import pytest

from fast_vae_decode.bench import flag_rounds
from fast_vae_decode.bench.cli import _modes, main


def _fake_tree(tmp_path) -> pathlib.Path:
    tree = tmp_path / "ComfyUI"
    (tree / "comfy").mkdir(parents=True)
    (tree / "nodes.py").write_text("")
    return tree


class _FakeBench:
    """Writes a bench JSON per command: high ms by side and round, so medians are checkable."""

    def __init__(self, ms_by_side, fail_round=None):
        self.ms_by_side, self.fail_round, self.commands = ms_by_side, fail_round, []

    def __call__(self, cmd):
        self.commands.append(cmd)
        path = pathlib.Path(cmd[cmd.index("--json") + 1])
        r, side = path.stem[len("round"):].split("-")
        r = int(r)
        if r == self.fail_round and side == "b":
            return 1
        rows = [{"case": case, "precision": "as loaded", "high_ms": ms[r]}
                for case, ms in self.ms_by_side[side].items()]
        rows.append({"case": "sdxl-1024", "precision": "fp32", "high_ms": 999.0})  # not a base row
        path.write_text(json.dumps({"results": rows}))
        return 0


def test_rounds_alternate_which_side_goes_first():
    a, b = flag_rounds.sides_for("--disable-dynamic-vram")
    order = [(r, s.label) for r, s in flag_rounds.round_order((a, b), 3)]
    assert order == [(0, a.label), (0, b.label), (1, b.label), (1, a.label), (2, a.label), (2, b.label)]
    assert b.flags == ("--disable-dynamic-vram",) and a.flags == ()


def test_each_side_is_the_median_of_its_rounds(tmp_path):
    sides = flag_rounds.sides_for("--disable-dynamic-vram")
    bench = _FakeBench({"a": {"sdxl-1024": [25.0, 23.0, 24.0]}, "b": {"sdxl-1024": [23.0, 24.0, 22.0]}})
    times = flag_rounds.run_rounds("/tree", "sdxl-1024", sides, 3, tmp_path, runner=bench)
    assert times == {("default flags", "sdxl-1024"): [25.0, 23.0, 24.0],
                     ("--disable-dynamic-vram", "sdxl-1024"): [23.0, 24.0, 22.0]}
    table = flag_rounds.compare_table(times, sides, ["sdxl-1024", "qwen-1024"])
    assert "| sdxl-1024 | 24.0 (23.0-25.0, 3 rounds) | 23.0 (22.0-24.0, 3 rounds) | +4.3% |" in table
    assert "| qwen-1024 | — | — | — |" in table  # a case no round measured
    cmd = bench.commands[1]
    assert cmd[cmd.index("--comfyui") + 1] == "/tree" and "--comfyui-args=--disable-dynamic-vram" in cmd
    assert "--triton-cache" in cmd and "keep" in cmd
    assert cmd[cmd.index("--paths") + 1] == "high"  # only what is compared is timed


def test_a_failed_round_is_left_out(tmp_path, capsys):
    sides = flag_rounds.sides_for("--novram")
    bench = _FakeBench({"a": {"c": [1.0, 2.0]}, "b": {"c": [3.0, 4.0]}}, fail_round=1)
    times = flag_rounds.run_rounds("/tree", "c", sides, 2, tmp_path, runner=bench)
    assert times[("--novram", "c")] == [3.0] and times[("default flags", "c")] == [1.0, 2.0]
    assert "round 1 (--novram): no results (exit status 1)" in capsys.readouterr().out


def test_modes_command_prints_the_comparison(tmp_path, capsys):
    tree = _fake_tree(tmp_path)
    args = main.__globals__["build_parser"]().parse_args(
        ["modes", "--comfyui", str(tree), "--cases", "qwen-1024", "--rounds", "2",
         "--out", str(tmp_path / "rounds")])
    bench = _FakeBench({"a": {"qwen-1024": [21.0, 19.0]}, "b": {"qwen-1024": [18.0, 20.0]}})
    assert _modes(args, runner=bench) == 0
    out = capsys.readouterr().out
    assert "| qwen-1024 | 20.0 (19.0-21.0, 2 rounds) | 19.0 (18.0-20.0, 2 rounds) | +5.3% |" in out
    assert len(list((tmp_path / "rounds").glob("round*.json"))) == 4


def test_modes_compares_a_bench_setting_under_the_same_flags(tmp_path, capsys):
    """``--against-bench``: side B is this pack's other setting under ComfyUI's defaults;
    ``--bench-args`` go to both sides."""
    tree = _fake_tree(tmp_path)
    args = main.__globals__["build_parser"]().parse_args(
        ["modes", "--comfyui", str(tree), "--cases", "sdxl-1024", "--rounds", "1",
         "--against-bench=--host-copies single", "--bench-args=--repeats 5",
         "--out", str(tmp_path / "rounds")])
    bench = _FakeBench({"a": {"sdxl-1024": [25.0]}, "b": {"sdxl-1024": [24.0]}})
    assert _modes(args, runner=bench) == 0
    a_cmd, b_cmd = bench.commands
    assert not any(c.startswith("--comfyui-args") for c in a_cmd + b_cmd)
    assert "--host-copies" not in a_cmd and b_cmd[-2:] == ["--host-copies", "single"]
    assert all(c[c.index("--repeats") + 1] == "5" for c in (a_cmd, b_cmd))
    assert "| case | high ms, default flags | high ms, --host-copies single |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,expected", [
    (["modes"], "needs a ComfyUI tree"),
    (["modes", "--against="], "--against: --against needs ComfyUI flags"),
])
def test_modes_says_what_it_needs(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    if "--against=" in argv:
        argv = argv + ["--comfyui", str(_fake_tree(tmp_path))]
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
