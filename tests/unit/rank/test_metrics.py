"""taas.rank.metrics: taas.log in a rank buffers rows and sends them as "metrics" events, at
most every interval from a thread and all at the cell's end; a full buffer is sent by the
logging thread itself; bad values are noted once per name."""

from __future__ import annotations

import threading
import time

from taas.job import metrics as rows_format
from taas.rank import metrics
from tests.support.forks import no_leftover_children, run_with_events  # noqa: F401 (an autouse fixture)


class Sent:
    def __init__(self):
        self.events = []
        self.threads = set()

    def __call__(self, kind, **fields):
        self.threads.add(threading.current_thread().name)
        self.events.append((kind, fields))

    def rows(self):
        return [tuple(row) for _, fields in self.events for row in fields["rows"]]


def test_rows_wait_for_the_thread_then_go_in_one_event():
    sent, notes = Sent(), []
    buffer = metrics.Buffer(send=sent, interval=0.05, write_note=notes.append)
    for step in range(5):
        buffer.log(step, {"loss": 1.0 / (step + 1)})
    assert sent.events == []  # nothing written by the caller
    deadline = time.monotonic() + 10
    while not sent.events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [kind for kind, _ in sent.events] == ["metrics"]
    assert sent.rows() == [(s, {"loss": 1.0 / (s + 1)}) for s in range(5)]
    assert sent.threads == {"taas-metrics"} and notes == []


def test_flush_sends_the_rest_in_bounded_events_and_steps_count_on():
    sent = Sent()
    buffer = metrics.Buffer(send=sent, interval=60)
    for _ in range(2500):
        buffer.log(None, {"x": 1})
    buffer.flush()
    assert [len(fields["rows"]) for _, fields in sent.events] == [1000, 1000, 500]
    assert [row[0] for row in sent.rows()] == list(range(2500))
    buffer.flush()  # nothing left: nothing sent
    assert len(sent.events) == 3


def test_a_full_buffer_is_sent_by_the_caller():
    sent = Sent()
    buffer = metrics.Buffer(send=sent, interval=60, capacity=100)
    for step in range(250):
        buffer.log(step, {"x": 0.5})
    assert len(sent.rows()) == 200 and "MainThread" in sent.threads


def test_bad_values_are_noted_once_per_name_and_the_rest_is_kept():
    sent, notes = Sent(), []
    buffer = metrics.Buffer(send=sent, interval=60, write_note=notes.append)
    buffer.log(0, {"loss": float("nan"), "acc": 0.5})
    buffer.log(1, {"loss": float("nan"), "items": [1, 2]})
    buffer.log(2, {"items": [3]})
    buffer.flush()
    assert sent.rows() == [(0, {"acc": 0.5})]
    assert notes == ["taas: taas.log: 'loss' is nan, not a finite number: not recorded (the job goes on)",
                     "taas: taas.log: 'items' is a list of 2, not a number: not recorded (the job goes on)"]


def test_in_a_rank_taas_log_reaches_the_events_pipe_cheaply():
    def body() -> int:
        import taas

        metrics.install()
        started = time.perf_counter()
        for step in range(20_000):
            taas.log(step=step, loss=0.5, lr=0.1)
        per_call = (time.perf_counter() - started) / 20_000
        taas.log(step=20_000, bad=[1])
        metrics.flush()
        rows_format.set_recorder(None)
        print(f"per call {per_call * 1e6:.1f} us", file=__import__("sys").stderr)
        return 0 if per_call < 1e-3 else 3  # a bound only a round trip per call would break

    run = run_with_events(body)
    assert run.code == 0, run.stderr
    rows = [row for event in run.events if event["kind"] == "metrics" for row in event["rows"]]
    assert len(rows) == 20_000 and rows[0] == [0, {"loss": 0.5, "lr": 0.1}] and rows[-1][0] == 19_999
    assert run.stderr.count("'bad' is a list of 1") == 1, run.stderr
