"""A rank's ``beat`` on the events pipe, read into a typed message or dropped (never fatal)."""

from __future__ import annotations

import json

import pytest

from taas.supervisor import events

GOOD = {"kind": "beat", "state": "waiting", "line": 9, "call": "all_reduce", "node": 1, "cpu": 12.5,
        "rss": 123456, "gpu_mem": 2048, "gpu_util": 40, "data": {"train": [12, 0.25]}}


def test_a_beat_is_read_with_every_field():
    beat = events.read(json.dumps(GOOD))
    assert beat == events.Beat("waiting", 9, "all_reduce", 1, 12.5, 123456, 2048, 40, (("train", 12, 0.25),))


def test_a_minimal_beat_gets_defaults():
    beat = events.read(json.dumps({"kind": "beat", "state": "starting"}))
    assert beat == events.Beat("starting", None, "", 0, 0.0, 0, None, None, ())


@pytest.mark.parametrize("field, value", [
    ("state", "sleeping"), ("state", None), ("line", "7"), ("call", 3), ("node", -1), ("cpu", "high"),
    ("cpu", float("nan")), ("rss", -5), ("rss", 1.5), ("gpu_mem", True), ("gpu_util", "50%"),
    ("data", [12, 0.2]), ("data", {"train": [12]}), ("data", {"train": ["12", 0.2]}),
])
def test_a_beat_with_a_bad_field_is_dropped(field, value, caplog):
    line = json.dumps({**GOOD, field: value})
    with pytest.raises(events.Malformed):
        events.read(line)
    assert events.parse("rank1", line) is None
    assert "ignored a line on rank1's events pipe" in caplog.text
