"""The live rank panel's table as data: rows in, text and HTML out (taas.io.panel)."""

from __future__ import annotations

import pytest

from taas.io import panel
from taas.io.panel import LoaderRow, RankRow

MB = 1 << 20


def rank(i: int, **fields) -> RankRow:
    defaults = dict(state="running", node=i // 8, line=7, call="train_step", quiet=0.4, cpu=99.0, rss=800 * MB)
    return RankRow(f"rank{i}", **{**defaults, **fields})


def test_a_row_per_rank_with_its_figures():
    text = panel.text("taas: 2 ranks, 3.0 s into the job",
                      [rank(0), rank(1, state="waiting", line=9, call="all_reduce", quiet=None, cpu=0.0)])
    lines = text.splitlines()
    assert lines[0] == "taas: 2 ranks, 3.0 s into the job"
    assert lines[1].split() == ["rank", "state", "line", "call", "quiet", "CPU", "RSS"]
    assert lines[2].split() == ["rank0", "running", "7", "train_step", "0.4", "s", "99%", "800", "MB"]
    assert lines[3].split() == ["rank1", "waiting", "9", "all_reduce", "0%", "800", "MB"]  # quiet: no output yet
    # columns line up
    assert lines[2].index("running") == lines[3].index("waiting") == lines[1].index("state")


def test_gpu_columns_only_when_some_rank_has_gpu_figures():
    assert "GPU" not in panel.text("t", [rank(0), rank(1)])
    text = panel.text("t", [rank(0, gpu_mem=2 * 1024 * MB, gpu_util=87), rank(1)])
    header, first, second = text.splitlines()[1:4]
    assert header.split()[-3:] == ["GPU", "mem", "GPU"]
    assert first.split()[-3:] == ["2.0", "GB", "87%"]
    assert second.split()[-2:] == ["800", "MB"]  # blank GPU cells


def test_many_ranks_are_grouped_per_node_with_their_states_counted():
    ranks = [rank(i, state="waiting" if i % 8 == 3 else "running", line=7 + (i % 8 == 3) * 2,
                  call="all_reduce" if i % 8 == 3 else "train_step") for i in range(32)]
    rows = panel.grouped(ranks)
    assert [r.node for r in rows] == [0, 1, 2, 3] and all(len(r.ranks) == 8 for r in rows)
    lines = panel.text("t", ranks).splitlines()
    assert lines[1].startswith("node ")
    assert lines[2].startswith("node0 (8 ranks)")
    assert "running 7, waiting 1" in lines[2] and "7, 9" in lines[2] and "train_step …" in lines[2]
    assert "6.2 GB" in lines[2]  # RSS summed over the node
    assert len(lines) == 2 + 4


def test_sixteen_ranks_still_get_a_row_each():
    assert len(panel.grouped([rank(i) for i in range(panel.GROUP_OVER)])) == panel.GROUP_OVER


def test_loader_workers_rows():
    text = panel.text("t", [rank(0)], [LoaderRow("loader:train:0", "loading", 12, 0.031),
                                       LoaderRow("loader:train:1", "done", 20, None)])
    assert text.splitlines()[-2].split() == ["loader:train:0", "loading", "12", "units", "data", "wait", "3%"]
    assert text.splitlines()[-1].split() == ["loader:train:1", "done", "20", "units"]


def test_html_is_a_table_and_escapes_what_it_shows():
    html = panel.as_html("taas: <2> ranks", [rank(0, call="<lambda>"), rank(1, state="failed")],
                         [LoaderRow("loader:train:0", "loading", 3, 0.5)])
    assert html.startswith('<div class="taas-panel"') and html.count("<tr>") == 4
    assert "&lt;lambda&gt;" in html and "<lambda>" not in html and "&lt;2&gt;" in html
    assert "#c62828" in html  # a failed rank stands out


@pytest.mark.parametrize("values, shown", [([7], "7"), ([7, 9, 7], "7, 9"), ([3, 4, 5, 9], "3-9"),
                                           ([None, None], "")])
def test_a_nodes_lines(values, shown):
    assert panel.lines(values) == shown


@pytest.mark.parametrize("nbytes, shown", [(None, ""), (512, "512 B"), (3 * MB // 2, "1.5 MB"),
                                           (800 * MB, "800 MB"), (12 << 30, "12 GB")])
def test_sizes(nbytes, shown):
    assert panel.size(nbytes) == shown


def test_the_summary_line():
    ranks = [rank(0, state="done"), rank(1, state="failed"), rank(2, state="stopped")]
    assert panel.summary(3, 12.34, ranks) == "taas: 3 ranks, 12 s: done 1, failed 1, stopped 1"
    assert panel.summary(1, 2.5, [rank(0, state="done")]) == "taas: 1 rank, 2.5 s: done 1"
