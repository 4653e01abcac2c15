"""taas.jobs.listing: the table ``taas jobs`` prints (pure: records and a clock in, text out)."""

from __future__ import annotations

import time

import pytest

from taas.jobs.api import JobRecord, Listed, State
from taas.io.panel import size as panel_size
from taas.jobs.listing import duration, render, size

NOW = 1_800_000_000.0


def listed(job_id: str, state: State = State.DONE, size: int = 2048, problem: str = "", **changes) -> Listed:
    values = dict(id=job_id, state=state, ranks=4, where="this machine", started=NOW - 300,
                  notebook="train.ipynb", first_line="trainer.fit(model)")
    if state.final:
        values["ended"] = NOW - 60
    values.update(changes)
    return Listed(JobRecord(**values), size=size, problem=problem)


def columns(text: str, count: int) -> tuple[list[str], list[dict]]:
    """The header's names and the ``count`` rows below it as {name: cell}, cut where the header's
    columns start (the notes after the rows are not rows)."""
    header, *lines = text.splitlines()
    names = header.split()
    starts = [header.index(name) for name in names]
    rows = [dict(zip(names, (line[a:b].strip() for a, b in zip(starts, starts[1:] + [None]))))
            for line in lines[:count]]
    return names, rows


def test_no_jobs_is_one_line():
    assert render([]) == "taas: no jobs (a cell run with --detach starts one)"


def test_a_row_per_job_in_aligned_columns():
    text = render([listed("a1b2c3", State.RUNNING, ended=None, size=5 << 20),
                   listed("d4e5f6", State.DONE, where="ray://head:10001", notebook="", first_line="x = 1")],
                  now=NOW)
    names, rows = columns(text, 2)
    assert names == ["ID", "STATE", "RANKS", "WHERE", "STARTED", "TIME", "SIZE", "NOTEBOOK", "CELL"]
    assert len(text.splitlines()) == 3
    started = time.strftime("%m-%d %H:%M", time.localtime(NOW - 300))
    assert rows[0] == {"ID": "a1b2c3", "STATE": "running", "RANKS": "4", "WHERE": "this machine",
                       "STARTED": started, "TIME": "5m00s", "SIZE": "5.0 MB", "NOTEBOOK": "train.ipynb",
                       "CELL": "trainer.fit(model)"}
    assert rows[1]["STATE"] == "done" and rows[1]["TIME"] == "4m00s"  # ended - started
    assert rows[1]["WHERE"] == "ray://head:10001" and rows[1]["NOTEBOOK"] == "" and rows[1]["CELL"] == "x = 1"
    assert all(line == line.rstrip() for line in text.splitlines())


def test_results_waiting_until_taken():
    text = render([listed("a1b2c3", has_results=True), listed("d4e5f6", has_results=True, taken=NOW - 5),
                   listed("aaaaaa")], now=NOW)
    _, rows = columns(text, 3)
    assert [row["STATE"] for row in rows] == ["done (results waiting)", "done", "done"]


def test_kept_ranks_read_kept_and_still_running_with_their_first_results_waiting():
    text = render([listed("a1b2c3", State.KEPT, has_results=True, keep=True),
                   listed("d4e5f6", State.KEPT, has_results=True, keep=True, taken=NOW - 5)], now=NOW)
    _, rows = columns(text, 2)
    assert [row["STATE"] for row in rows] == ["kept (results waiting)", "kept"]
    assert [row["TIME"] for row in rows] == ["5m00s", "5m00s"]  # not ended: counted to now
    assert not State.KEPT.final


def test_failed_and_lost_jobs_have_their_cause_below():
    text = render([listed("a1b2c3", State.FAILED, cause="RuntimeError: CUDA out of memory"),
                   listed("d4e5f6", State.LOST, cause="its supervisor (pid 7) ended without a word"),
                   listed("aaaaaa", State.CANCELLED, cause="cancelled"),
                   listed("bbbbbb", State.FAILED, cause="")], now=NOW)
    lines = text.splitlines()
    assert lines[5:] == ["a1b2c3 failed: RuntimeError: CUDA out of memory",
                         "d4e5f6 lost: its supervisor (pid 7) ended without a word"]


def test_a_long_cause_is_cut_to_one_line():
    text = render([listed("a1b2c3", State.FAILED, cause="Error:\n" + "word " * 100)], now=NOW)
    note = text.splitlines()[-1]
    assert note.startswith("a1b2c3 failed: Error: word word")
    assert note.endswith("…") and len(note) == len("a1b2c3 failed: ") + 160


def test_an_unreadable_record_is_a_row_and_its_problem_below():
    problem = "taas: job bad000's record is damaged (JSONDecodeError: ...); `taas forget bad000` removes it"
    text = render([listed("a1b2c3"), listed("bad000", State.LOST, size=10, problem=problem)], now=NOW)
    _, rows = columns(text, 2)
    assert rows[1]["ID"] == "bad000" and rows[1]["STATE"] == "unreadable" and rows[1]["SIZE"] == "10 B"
    assert rows[1]["RANKS"] == rows[1]["NOTEBOOK"] == ""
    assert text.splitlines()[-1] == f"bad000: {problem}"


def test_long_notebooks_and_cells_are_cut_and_whitespace_collapsed():
    text = render([listed("a1b2c3", notebook="experiments/2026/very-long-notebook-name.ipynb",
                          first_line="model   =  build(" + "x, " * 40 + ")")], now=NOW)
    _, [row] = columns(text, 1)
    assert row["NOTEBOOK"] == "experiments/2026/very-l…" and len(row["NOTEBOOK"]) == 24
    assert row["CELL"].startswith("model = build(x, x,") and row["CELL"].endswith("…")
    assert len(row["CELL"]) == 40


def test_a_running_job_without_ranks_yet():
    text = render([listed("a1b2c3", State.WAITING, ranks=0, ended=None)], now=NOW)
    _, [row] = columns(text, 1)
    assert row["STATE"] == "waiting" and row["RANKS"] == ""


def test_the_clock_defaults_to_now():
    text = render([listed("a1b2c3", State.RUNNING, ended=None, started=time.time() - 2)])
    _, [row] = columns(text, 1)
    assert row["TIME"] in ("2s", "3s", "4s")


@pytest.mark.parametrize("seconds, text", [
    (-5, "0s"), (0, "0s"), (59.9, "59s"), (60, "1m00s"), (61, "1m01s"), (3599, "59m59s"), (3600, "1h00m"),
    (3660, "1h01m"), (86399, "23h59m"), (86400, "1d00h"), (90000, "1d01h"), (30 * 86400, "30d00h")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_sizes_are_written_as_the_rank_panel_writes_them():
    assert size is panel_size  # one way to write a size (taas.io.panel)


def test_attach_without_an_id_means_this_notebooks_running_job_then_any_running_then_results_waiting():
    from taas.jobs.listing import default_job

    mine = listed("a1", State.RUNNING, notebook="train.ipynb")
    other = listed("b2", State.RUNNING, notebook="other.ipynb")
    waiting = listed("c3", State.DONE, has_results=True)
    taken = listed("d4", State.DONE, has_results=True, taken=NOW - 10)
    broken = listed("e5", State.RUNNING, notebook="train.ipynb", problem="damaged")
    newest_first = [broken, waiting, other, mine, taken]
    assert default_job(newest_first, "train.ipynb") == "a1"  # this notebook's, though not the newest
    assert default_job(newest_first, "eval.ipynb") == "b2"  # the newest running one
    assert default_job(newest_first, "") == "b2"
    assert default_job([taken, waiting], "train.ipynb") == "c3"  # results wait there, not in d4
    assert default_job([taken, broken], "train.ipynb") is None  # a damaged record is never chosen
