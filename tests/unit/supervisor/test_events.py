"""Table tests of taas.supervisor.events: each events-pipe line is a typed message, or None (logged)."""

from __future__ import annotations

import json
import logging

import pytest

from taas.supervisor import events
from taas.supervisor.events import Comm, DataFigure, Display, Done, Stack, Up

FRAME = {"filename": "<cell>", "lineno": 3, "name": "<module>", "line": "x = 1"}


def line(**message) -> str:
    return json.dumps(message) + "\n"


@pytest.mark.parametrize("text, expected", [
    (line(kind="display", data={"text/plain": "hi"}, metadata={}), Display({"text/plain": "hi"}, {})),
    (line(kind="display", data={"text/plain": "hi"}), Display({"text/plain": "hi"}, {})),
    (line(kind="stack", frames=[FRAME], line=3, call="x = 1"), Stack(3, "x = 1", (FRAME,))),
    (line(kind="stack", frames=[], line=None, call=""), Stack(None, "", ())),
    (line(kind="stack", frames=[{**FRAME, "lineno": None}], line=None, call=None),
     Stack(None, "", ({**FRAME, "lineno": None},))),
    (line(kind="up"), Up()),
    (line(kind="done"), Done()),
    (line(kind="done", extra="ignored"), Done()),
    (line(kind="done", failed=False, gpu_mem=None), Done()),
    (line(kind="done", failed=True, gpu_mem=3 << 20), Done(failed=True, gpu_mem=3 << 20)),
    (line(kind="done", gpu_mem="lots"), Done()),  # a bad figure never loses a rank's "done"
    (line(kind="comm", ops=12), Comm(12)),
    (line(kind="comm", ops=None), Comm(None)),
])
def test_messages_taas_sends_are_read(text, expected):
    assert events.parse("rank0", text) == expected


@pytest.mark.parametrize("message", [
    {"kind": "data.progress", "loader": "train", "worker": 0, "produced": 4, "ready": True, "done": False},
    {"kind": "data.progress", "loader": "train", "worker": 1, "produced": 0},
    {"kind": "data.started", "loader": "train", "rank": 0, "prefetch_s": 0.25},
    {"kind": "data.stats", "loader": "train", "rank": 1, "units": 8, "bytes": 1024, "wait_s": 0.0,
     "elapsed_s": 1.5},
    {"kind": "data.future-figure", "loader": "train"},  # the plane ignores kinds it does not know
])
def test_data_plane_figures_pass_as_sent(message):
    assert events.parse("loader:train:0", json.dumps(message)) == DataFigure(message["kind"], message)


MALFORMED = [
    b'{"kind": "display", "data": 5}',  # the line that used to fail the job (TypeError in IPython)
    b"not json",
    b"[1, 2]",
    b'"a string"',
    b"12",
    b"null",
    b"{}",
    b'{"kind": 3}',
    b'{"kind": "no such kind"}',
    b'{"kind": "display"}',
    b'{"kind": "display", "data": {"text/plain": "x"}, "metadata": []}',
    b'{"kind": "stack", "frames": 7}',
    b'{"kind": "stack", "frames": [{"filename": "f"}]}',
    b'{"kind": "stack", "frames": [{"filename": "f", "name": "g"}]}',
    b'{"kind": "stack", "frames": [{"filename": "f", "name": "g", "lineno": 1, "line": 2}]}',
    b'{"kind": "stack", "frames": [], "line": "three"}',
    b'{"kind": "comm", "ops": "many"}',
    b'{"kind": "comm", "ops": true}',
    b'{"kind": "comm"}',
    b'{"kind": "data.progress", "loader": 3, "worker": 0, "produced": 1}',
    b'{"kind": "data.progress", "loader": "train"}',
    b'{"kind": "data.progress", "loader": "train", "worker": "0", "produced": 1}',
    b'{"kind": "data.progress", "loader": "train", "worker": 0, "produced": 1, "ready": "yes"}',
    b'{"kind": "data.started", "loader": "train", "prefetch_s": "slow"}',
    b'{"kind": "data.started", "loader": "train", "prefetch_s": NaN}',
    b'{"kind": "data.stats", "loader": "train", "rank": 0, "units": 1}',
    (b'{"kind": "data.stats", "loader": "train", "rank": 0, "units": 1, "bytes": 1, "wait_s": 0,'
     b' "elapsed_s": Infinity}'),
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser's recursion limit
    b'{"kind": "done", "n": 1' + b"0" * 5000 + b"}",  # more digits than int() takes
    b"\xff\xfe not utf-8",
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_a_line_that_is_not_a_message_is_ignored_and_logged(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="taas"):
        assert events.parse("rank1", raw.decode(errors="replace") + "\n") is None
    assert len(caplog.records) == 1 and "rank1's events pipe" in caplog.records[0].getMessage()
    assert caplog.records[0].name.startswith("taas.")
    assert len(caplog.records[0].getMessage()) < 1000  # a huge line is not copied whole


def test_an_empty_line_is_ignored_quietly(caplog):
    with caplog.at_level(logging.WARNING, logger="taas"):
        assert events.parse("rank0", "\n") is None
    assert caplog.records == []


# -- metrics rows (taas.rank.metrics) -----------------------------------------------------------
def test_metrics_rows_are_read():
    message = events.parse("rank1", line(kind="metrics", rows=[[0, {"loss": 0.5}], [1, {"loss": 1, "acc": 0.25}]]))
    assert message == events.Metrics(((0, {"loss": 0.5}), (1, {"loss": 1, "acc": 0.25})))


@pytest.mark.parametrize("rows", [
    None, 3, [[0]], [[0, {"loss": "high"}]], [[0.5, {"loss": 1.0}]], [["0", {}]], [[0, {"loss": True}]],
    [[0, [1.0]]], [[0, {"loss": None}]],
])
def test_malformed_metrics_are_dropped(rows, caplog):
    with caplog.at_level(logging.WARNING, logger="taas.supervisor.events"):
        assert events.parse("rank0", line(kind="metrics", rows=rows)) is None
    assert "ignored a line on rank0's events pipe" in caplog.text
    assert events.parse("rank0", '{"kind": "metrics", "rows": [[0, {"x": NaN}]]}') is None
