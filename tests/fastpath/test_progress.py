"""``fastpath.progress``: how a decode's chunk reports reach the caller (tier 1)."""
from __future__ import annotations

import pytest

from fast_vae_decode.fastpath.progress import advance, nested, progress_to


def _run(decode):
    seen = []
    with progress_to(lambda done, total: seen.append((done, total))):
        decode()
    return seen


def test_chunk_reports_pass_through_and_end_at_the_total():
    assert _run(lambda: [advance(d, 3) for d in (1, 2, 3)]) == [(1, 3), (2, 3), (3, 3)]


def test_a_decode_without_chunks_still_ends_the_bar_full():
    """E.g. an image decode that ComfyUI's own VAE.decode runs: one report, at its end."""
    assert _run(lambda: None) == [(1, 1)]
    assert _run(lambda: advance(1, 2)) == [(1, 2), (1, 1)]  # stopped short of its total


def test_nested_chunks_cover_one_bar():
    def batch_of_two():
        for item in range(2):
            with nested(item, 10, 2):
                advance(1, 2)
                advance(2, 2)

    assert _run(batch_of_two) == [(5, 20), (10, 20), (15, 20), (20, 20)]


def test_a_decode_stopped_by_its_report_reports_no_end():
    seen = []

    def report(done, total):
        seen.append((done, total))
        raise KeyboardInterrupt  # as ComfyUI's interrupt exception stops it

    with pytest.raises(KeyboardInterrupt):
        with progress_to(report):
            advance(1, 3)
            advance(2, 3)
    assert seen == [(1, 3)]


def test_advance_outside_a_block_does_nothing():
    advance(1, 1)
