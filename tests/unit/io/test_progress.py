"""The prefetch line (taas.io.progress): text as data."""

from __future__ import annotations

import pytest

from taas.io.progress import BAR_WIDTH, bar, prefetch_line


def test_the_line_reads_as_before():
    assert prefetch_line("train", 12, 120) == "taas: loader `train` ██" + "·" * 18 + " 12/120 units ready"
    assert prefetch_line("dl", 6, 8, started=True) == (
        "taas: loader `dl` ███████████████····· 6/8 units ready; ranks start, loading goes on")


@pytest.mark.parametrize("n, total, expected", [
    (0, 6, "·" * 20),
    (2, 6, "██████▋" + "·" * 13),  # eighths: a third of 20 characters
    (6, 6, "█" * 20),
    (7, 6, "█" * 20),  # more than the total: full, never tqdm's unknown-total form
    (3, 0, "█" * 20),  # nothing to wait for
    (-1, 6, "·" * 20),
])
def test_bar(n, total, expected):
    assert bar(n, total) == expected and len(expected) == BAR_WIDTH


def test_the_bar_only_grows():
    bars = [bar(n, 37) for n in range(38)]
    eighths = {c: i for i, c in enumerate("·▏▎▍▌▋▊▉█")}
    filled = [sum(eighths[c] for c in b) / 8 for b in bars]
    assert filled == sorted(filled) and filled[0] == 0 and filled[-1] == BAR_WIDTH
