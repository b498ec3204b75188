"""``profile --host-top``'s summary (``bench/host_profile.py``) of a plain Python call: the
function the host spent its time in is named with its call count. (Real decodes are profiled
only on a GPU, by hand.)"""
from __future__ import annotations

from fast_vae_decode.bench import host_profile


def _leaf(n):
    return sum(i * i for i in range(n))


def _work():
    return [_leaf(2000) for _ in range(7)]


def test_the_functions_called_are_listed_with_their_calls_and_times():
    stats, result = host_profile.profile_host(_work)
    assert len(result) == 7
    rows = {r.where.split("(")[-1].rstrip(")"): r for r in host_profile.host_rows(stats, 50, "total")}
    assert rows["_leaf"].calls == 7 and rows["_work"].calls == 1
    assert rows["_work"].total_ms >= rows["_leaf"].total_ms > 0
    assert rows["_leaf"].where.startswith("bench/test_host_profile.py:")  # last two path parts


def test_rows_are_ranked_by_own_time_or_with_callees():
    stats, _ = host_profile.profile_host(_work)
    own = host_profile.host_rows(stats, 5, "own")
    total = host_profile.host_rows(stats, 5, "total")
    assert [r.own_ms for r in own] == sorted((r.own_ms for r in own), reverse=True)
    assert [r.total_ms for r in total] == sorted((r.total_ms for r in total), reverse=True)
    text = host_profile.host_markdown(stats, 5)
    assert text.count("| function | calls |") == 2 and "_work" in text
