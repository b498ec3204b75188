"""``interleave``: the pack's run-time switches compared in one process, decode by decode."""
from __future__ import annotations

import json

import pytest
import torch

from fast_vae_decode.bench import interleave
from fast_vae_decode.fastpath.families.kl.settings import settings as kl_settings
from fast_vae_decode.fastpath.pixels.decode import pixel_settings
from fast_vae_decode.fastpath.pixels.finish import host_copy
from support.cli import run_cli


def test_a_variant_is_a_name_and_bench_options():
    v = interleave.parse_variant("split+nib=--host-copies split --kl-setting 'norm_input_bias=true'")
    assert v == interleave.Variant("split+nib", ("--host-copies", "split", "--kl-setting",
                                                 "norm_input_bias=true"))
    assert interleave.parse_variant("as-set=").options == ()


@pytest.mark.parametrize("texts,message", [
    (["a=", "--host-copies split"], "NAME=OPTIONS"),  # no name
    (["a="], "at least two"),  # nothing to compare with
    (["a=", "a=--host-copies split"], "repeat"),
    (["a=", "b=--kl-setting 'x"], "quotation"),  # shlex cannot split it
    (["stock=--host-copies split", "b="], "--stock's row"),  # the stock row's name is taken
])
def test_bad_variants_say_what_was_expected(texts, message):
    with pytest.raises(ValueError, match=message):
        interleave.parse_variants(texts)


def test_with_stock_one_variant_is_enough_and_none_means_high_as_set():
    assert interleave.parse_variants(["a=--host-copies split"], stock=True) == \
        [interleave.Variant("a", ("--host-copies", "split"))]
    assert interleave.parse_variants([], stock=True) == [interleave.Variant("high", ())]
    with pytest.raises(ValueError, match="stock"):
        interleave.parse_variants(["stock="], stock=True)


def test_every_round_runs_every_variant_once_in_its_own_order():
    names = ["a", "b", "c", "d"]
    order = interleave.schedule(names, rounds=10, seed=3)
    rounds = [order[i:i + 4] for i in range(0, 40, 4)]
    assert all(sorted(r) == names for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # shuffled, not one fixed order
    assert order == interleave.schedule(names, rounds=10, seed=3)


def test_each_decode_runs_under_its_own_variant():
    """Warm-up decodes first per variant, then one timed decode per variant and round, each
    with that variant's switch live."""
    live = {"value": None}
    seen: list[str] = []
    applies = {name: (lambda n=name: live.__setitem__("value", n)) for name in ("x", "y", "z")}

    def decode():
        seen.append(live["value"])

    def timed(fn):
        fn()
        return {"x": 1.0, "y": 2.0, "z": 3.0}[live["value"]], live["value"]

    result = interleave.run_interleaved(decode, applies, rounds=5, warmup=2, timed=timed,
                                        path_of=lambda value: f"path {value}")
    assert seen[:6] == ["x", "x", "y", "y", "z", "z"]
    assert result.times == {"x": [1.0] * 5, "y": [2.0] * 5, "z": [3.0] * 5}
    assert sorted(seen[6:]) == sorted(["x", "y", "z"] * 5)
    assert result.paths == {"x": ["path x"], "y": ["path y"], "z": ["path z"]}


def test_a_row_with_its_own_decode_takes_its_turn_in_every_round():
    """The stock row decodes through its own call (VAEDecode), in its warm-up and in every
    round, while the variants decode through the shared one."""
    calls: list[str] = []
    result = interleave.run_interleaved(
        lambda: calls.append("high") or "high", {"stock": lambda: None, "a": lambda: None},
        rounds=4, warmup=1, timed=lambda fn: (1.0 if fn() == "stock" else 4.0, None),
        decodes={"stock": lambda: calls.append("stock") or "stock"})
    assert calls[:2] == ["stock", "high"]  # warm-ups in the rows' order
    assert sorted(calls[2:]) == ["high"] * 4 + ["stock"] * 4
    assert result.times == {"stock": [1.0] * 4, "a": [4.0] * 4}


def test_speedup_over_stock_pairs_the_times_of_one_round():
    # Stock slows down over the run and the variant with it: per-round ratios stay at 2x, where
    # medians of each row alone would read 15 / 7.5 as well, but the quartiles say how steady.
    assert interleave.round_speedups([10.0, 20.0, 30.0], [5.0, 10.0, 15.0]) == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        interleave.round_speedups([10.0, 20.0], [5.0])  # rows of unequal rounds: not paired


def test_summary_with_stock_gives_each_variant_its_speedup_and_the_stock_before_install():
    variants = [interleave.Variant("high", ())]
    result = interleave.Interleaved({"stock": [100.0, 120.0, 90.0], "high": [20.0, 30.0, 18.0]},
                                    {"stock": ["stock"], "high": ["high: 2 fused modules"]})
    table = interleave.summary_table({"case": result}, variants, {"case": [95.0, 96.0, 97.0]})
    assert "| case | high | (as set) | 20.0 (18.0-30.0, 3) | — | 5.00x (4.00-5.00) | high: 2 fused modules |" in table
    assert "| case | stock | stock decode | 100.0 (90.0-120.0, 3) | — | — | stock |" in table
    assert "| case | stock before install | stock decode, timed before the rounds | 96.0 (95.0-97.0, 3) | — | — | stock |" in table


def test_a_path_change_during_the_rounds_is_kept():
    """A module that falls back mid-run changes what later decodes report: every distinct
    path of a variant is kept, in order, for the table."""
    reports = iter(["high: 19 fused modules"] * 2 + ["high: 18 fused modules, 1 stock"] * 4)
    result = interleave.run_interleaved(lambda: None, {"a": lambda: None, "b": lambda: None},
                                        rounds=3, warmup=0, timed=lambda fn: (1.0, next(reports)),
                                        path_of=lambda text: text)
    assert sum(len(p) for p in result.paths.values()) >= 3
    assert any(len(p) == 2 for p in result.paths.values())


def test_switches_go_back_to_what_the_process_had(monkeypatch):
    monkeypatch.setattr(kl_settings, "norm_input_bias", True)
    monkeypatch.setattr(host_copy, "parts", 4)
    switches = interleave.Switches()
    kl_settings.norm_input_bias, host_copy.parts = False, 1
    pixel_settings.cast_latent_on_device = not pixel_settings.cast_latent_on_device
    switches.restore()
    assert kl_settings.norm_input_bias is True and host_copy.parts == 4
    assert switches.saved[2].cast_latent_on_device == pixel_settings.cast_latent_on_device


def test_triton_launch_is_a_switch_that_goes_back(monkeypatch):
    from fast_vae_decode.bench.cli import _apply_switches
    from fast_vae_decode.kernels.direct_launch import launch_settings

    monkeypatch.setattr(launch_settings, "direct", True)
    switches = interleave.Switches()
    _apply_switches(None, [], "jit")
    assert launch_settings.direct is False
    switches.restore()
    assert launch_settings.direct is True


def test_wan_settings_are_switches_that_go_back(monkeypatch):
    from fast_vae_decode.bench.cli import _apply_switches
    from fast_vae_decode.fastpath.families.wan.settings import settings as wan_settings

    monkeypatch.setattr(wan_settings, "attention", "auto")
    switches = interleave.Switches()
    _apply_switches(None, [], None, ["attention=sdpa", "attention_budget_bytes=4096"])
    assert (wan_settings.attention, wan_settings.attention_budget_bytes) == ("sdpa", 4096)
    switches.restore()
    assert wan_settings.attention == "auto"


def test_summary_compares_each_variant_with_the_first():
    variants = [interleave.Variant("a", ()), interleave.Variant("b", ("--host-copies", "split"))]
    result = interleave.Interleaved({"a": [10.0, 10.0, 10.0], "b": [9.0, 9.5, 9.0]},
                                    {"a": ["high: 2 fused modules"], "b": []})
    table = interleave.summary_table({"case": result}, variants)
    assert "| case | a | (as set) | 10.0 (10.0-10.0, 3) | — | high: 2 fused modules |" in table
    assert "| case | b | --host-copies split | 9.0 (9.0-9.5, 3) | -10.0% | — |" in table


def test_interleave_runs_tiny_cases_and_leaves_the_switches_as_they_were(tmp_path):
    pytest.importorskip("diffusers")
    before = (kl_settings.norm_input_bias, host_copy.memmove, host_copy.parts,
              pixel_settings.cast_latent_on_device)
    path = tmp_path / "interleave.json"
    code, out = run_cli(["interleave", "--no-comfyui", "--cases", "tiny-sdxl", "--rounds", "3",
                         "--warmup", "1", "--json", str(path),
                         "--variant", "pooled=--host-copies pooled",
                         "--variant", "nib-off=--kl-setting norm_input_bias=false",
                         "--variant", "as-set="])
    assert code == 0
    assert "| tiny-sdxl | nib-off | --kl-setting norm_input_bias=false |" in out
    data = json.loads(path.read_text())
    assert {name: len(t) for name, t in data["times_ms"]["tiny-sdxl"].items()} == \
        {"pooled": 3, "nib-off": 3, "as-set": 3}
    assert data["variants"]["pooled"] == ["--host-copies", "pooled"]
    assert all(paths for paths in data["paths"]["tiny-sdxl"].values())  # each decode's path
    assert "commit" in data and data["comfyui"] is None
    assert (kl_settings.norm_input_bias, host_copy.memmove, host_copy.parts,
            pixel_settings.cast_latent_on_device) == before


def test_interleave_with_stock_times_stock_in_the_rounds_and_before_install(tmp_path):
    pytest.importorskip("diffusers")
    path = tmp_path / "interleave.json"
    code, out = run_cli(["interleave", "--no-comfyui", "--cases", "tiny-sdxl", "--rounds", "3",
                         "--warmup", "1", "--json", str(path), "--stock"])
    assert code == 0
    assert "| tiny-sdxl | stock | stock decode |" in out
    assert "| tiny-sdxl | stock before install |" in out
    data = json.loads(path.read_text())
    assert {name: len(t) for name, t in data["times_ms"]["tiny-sdxl"].items()} == \
        {"stock": 3, "high": 3}
    assert data["paths"]["tiny-sdxl"]["stock"] == ["stock"]
    assert data["paths"]["tiny-sdxl"]["high"] and "stock" not in data["paths"]["tiny-sdxl"]["high"]
    assert len(data["stock_before_install_ms"]["tiny-sdxl"]) == 3
    assert data["stock_note"] is None and "Note:" not in out  # no ComfyUI: one model per turn


def test_the_stock_rounds_under_dynamic_vram_carry_a_note():
    """On 0.33's default flags the twin and the fast model take turns being loaded, which
    doubled high's image-case rounds on the GPU: the table must say what it timed."""
    note = interleave.stock_note("dynamic VRAM")
    assert note and "alternating two VAEs" in note and "bench" in note
    assert interleave.stock_note("legacy (NORMAL_VRAM)") is None
    assert interleave.stock_note(None) is None


def test_the_stock_row_decodes_a_twin_the_pack_never_installs_in(monkeypatch):
    """An installed model's closed gate takes the pack's bit-exact cheaper paths: timed as
    stock, it would flatter every speed-up. The stock row's model must stay uninstalled."""
    pytest.importorskip("diffusers")
    from fast_vae_decode.bench import cli, subjects

    built = []
    real = subjects.build_subject

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(subjects, "build_subject", recording)
    code, _ = run_cli(["interleave", "--no-comfyui", "--cases", "tiny-sdxl", "--rounds", "2",
                       "--warmup", "0", "--stock"])
    assert code == 0
    high, twin = built
    assert cli.installed_models(high.vae) and not cli.installed_models(twin.vae)
    assert torch.equal(high.latent, twin.latent)


@pytest.mark.parametrize("variant,message", [
    ("b=--pixel-finish comfyui", "only --host-copies, --kl-setting, --wan-setting and --triton-launch"),  # not a run-time switch
    ("b=--host-copies nope", "invalid choice"),
    ("b=--kl-setting no_such=1", "NAME one of"),  # checked before any model is built
])
def test_interleave_refuses_what_it_cannot_switch(variant, message, capsys):
    code, _ = run_cli(["interleave", "--no-comfyui", "--cases", "tiny-sdxl",
                       "--variant", "a=", "--variant", variant])
    assert code == 2
    assert message in capsys.readouterr().err
