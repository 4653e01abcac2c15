"""The data plane's events (loader workers and ranks -> kernel) are typed at both ends, and the
kernel ignores, with a log line, an event line it cannot read: a rank's own code can write
anything to the events pipe, and that must never fail the job."""

from __future__ import annotations

import json
import logging
import os

import pytest

from taas import directive
from taas.data import messages
from taas.data.plane import DataPlane

GOOD = [
    messages.Progress(loader="data", worker=1, produced=5, ready=True, done=False),
    messages.Started(loader="data", rank=0, prefetch_s=0.25),
    messages.Stats(loader="data", rank=1, units=5, bytes=1000, wait_s=0.5, elapsed_s=2.0),
]

MALFORMED = [
    5,
    [1, 2],
    "not json",
    None,
    {},
    {"kind": "data.nope", "loader": "data"},
    {"kind": "data.progress"},  # fields missing
    {"kind": "data.progress", "loader": "data", "worker": "0", "produced": 1},
    {"kind": "data.progress", "loader": "data", "worker": -1, "produced": 1},
    {"kind": "data.progress", "loader": "data", "worker": True, "produced": 1},  # a bool is no worker
    {"kind": "data.progress", "loader": 7, "worker": 0, "produced": 1},
    {"kind": "data.progress", "loader": "data", "worker": 0, "produced": 1, "ready": "yes"},
    {"kind": "data.started", "loader": "data", "rank": 0, "prefetch_s": float("nan")},
    {"kind": "data.stats", "loader": "data", "rank": 0, "units": 1, "bytes": 1, "wait_s": 0.1},
    {"kind": "data.stats", "loader": "data", "rank": 0, "units": 1.5, "bytes": 1, "wait_s": 0.1, "elapsed_s": 1},
]


@pytest.mark.parametrize("message", GOOD, ids=lambda m: m.KIND)
def test_a_message_travels_as_one_event_line_and_reads_back_equal(message, monkeypatch):
    read, write = os.pipe()
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write))
    try:
        messages.send(message)
        line = os.read(read, 65536).decode()
    finally:
        os.close(read)
        os.close(write)
    assert line.endswith("\n") and line.count("\n") == 1
    decoded = json.loads(line)
    assert decoded["kind"] == message.KIND
    assert messages.parse(decoded) == message


@pytest.mark.parametrize("message", MALFORMED, ids=repr)
def test_a_line_that_is_not_a_data_message_is_none_and_logged(message, caplog):
    caplog.set_level(logging.WARNING, logger="taas")
    assert messages.parse(message) is None
    assert [r for r in caplog.records if r.name == "taas" and "ignored" in r.getMessage()]


def test_defaults_fill_fields_an_older_sender_left_out():
    parsed = messages.parse({"kind": "data.progress", "loader": "data", "worker": 0, "produced": 3})
    assert parsed == messages.Progress("data", 0, 3, ready=False, done=False)


class _Sink:
    def __init__(self):
        self.shown = []

    def progress(self, key, stream, text, final):
        self.shown.append(text)


def test_the_plane_ignores_what_it_cannot_read_and_keeps_the_rest(registered, caplog):
    caplog.set_level(logging.WARNING, logger="taas")
    data = registered(list(range(20)))
    plane = DataPlane.plan({"data": data}, directive.parse_options("--gpus 2 --cpus 2 --units 20"), 2, "cpu")
    sink = _Sink()
    bad = MALFORMED + [
        {"kind": "data.progress", "loader": "data", "worker": 2, "produced": 1, "ready": True},  # 2 workers
        {"kind": "data.stats", "loader": "data", "rank": 5, "units": 9, "bytes": 9, "wait_s": 0.0,
         "elapsed_s": 1.0},  # 2 ranks
    ]
    for message in bad:
        plane.on_event("rank1", message, sink)  # never raises
    assert not plane.ready() and plane.summary() == []
    for worker in (0, 1):
        plane.on_event(f"loader:data:{worker}", {"kind": "data.progress", "loader": "data", "worker": worker,
                                                 "produced": 10, "ready": True, "done": True}, sink)
    for rank in (0, 1):
        plane.on_event(f"rank{rank}", {"kind": "data.stats", "loader": "data", "rank": rank, "units": 10,
                                       "bytes": 4000, "wait_s": 0.25, "elapsed_s": 1.0}, sink)
    assert plane.ready() and "20/20 units ready" in sink.shown[-1]
    (line,) = plane.summary()
    assert "20/20 units delivered to 2 ranks by 2 workers, 8.0 kB moved" in line and "waited for data 25.0%" in line
    ignored = [r for r in caplog.records if r.name == "taas" and "ignored" in r.getMessage()]
    assert len(ignored) == len(bad)
