"""The ``attention`` command: the KL mid-block attention per call on each path (tier 1: the
CPU under TRITON_INTERPRET, one tiny case; nothing is timed, only the rows' content checked)."""
from __future__ import annotations

import json

import pytest

from fast_vae_decode.bench.attention import CANDIDATES, config_name, parse_config
from fast_vae_decode.bench.cli import main
from fast_vae_decode.kernels import exp_scores


def test_every_path_gets_a_row_with_its_error(tmp_path, capsys):
    path = tmp_path / "attention.json"
    default = exp_scores.EXP_SCORES_CONFIG
    code = main(["attention", "--cases", "tiny-sdxl", "--configs", "16x32x16w4s1",
                 "--repeats", "1", "--device", "cpu", "--json", str(path)])
    assert code == 0
    assert exp_scores.EXP_SCORES_CONFIG is default  # the tried config is not left set
    rows = json.loads(path.read_text())["results"]
    assert [r["path"] for r in rows] == ["chunked", "sdpa", "exp_scores:16x32x16w4s1"]
    for row in rows:
        assert row["error"] is None and (row["batch"], row["tokens"]) == (1, 64)
        assert row["max_abs_error"] < 0.05  # bf16 attention against fp32 (measured ~3e-3)
    assert rows[2]["tripped"] is False and rows[0]["tripped"] is None
    assert "| tiny-sdxl | 1 x 64 | exp_scores:16x32x16w4s1 |" in capsys.readouterr().out


def test_config_names_round_trip():
    assert all(parse_config(config_name(c)) == c for c in CANDIDATES)
    assert CANDIDATES[0] == exp_scores.EXP_SCORES_CONFIG  # the first candidate is the default


@pytest.mark.parametrize("argv, needle", [
    (["--cases", "wan21-480p-33"], "not a KL image case"),
    (["--configs", "128x128"], "BMxBNxBK"),
])
def test_mistakes_get_one_line(capsys, argv, needle):
    code = main(["attention", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_the_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code = main(["attention", "--cases", "tiny-sdxl", "--device", "cpu"])
    assert code == 2 and "CUDA GPU" in capsys.readouterr().err
