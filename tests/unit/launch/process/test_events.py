"""taas.launch.process.events: one JSON object a line on the pipe named by TAAS_EVENTS_FD."""

from __future__ import annotations

import json
import os
import threading

import pytest

from taas.launch.process import events
from tests.support.forks import no_leftover_children, run_with_events  # noqa: F401 (an autouse fixture)


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    yield read_end, write_end
    for fd in (read_end, write_end):
        try:
            os.close(fd)
        except OSError:  # closed by the test
            pass


def test_nothing_is_written_when_no_events_fd_is_set(pipe, monkeypatch):
    read_end, _ = pipe
    monkeypatch.delenv("TAAS_EVENTS_FD", raising=False)
    events.send("display", data={"text/plain": "x"})  # no error, no write anywhere
    with pytest.raises(BlockingIOError):
        os.read(read_end, 1)


def test_a_message_is_one_json_line_on_the_fd(pipe, monkeypatch):
    read_end, write_end = pipe
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write_end))
    events.send("comm", ops=3)
    events.send("display", data={"text/plain": "ünïcode"}, metadata={})
    lines = os.read(read_end, 1 << 16).decode().split("\n")
    assert lines[-1] == ""  # every message ends with its newline
    assert [json.loads(line) for line in lines[:-1]] == [
        {"kind": "comm", "ops": 3},
        {"kind": "display", "data": {"text/plain": "ünïcode"}, "metadata": {}},
    ]


def test_several_messages_go_in_order_in_one_write(pipe, monkeypatch):
    read_end, write_end = pipe
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write_end))
    writes = []
    real_write = os.write
    monkeypatch.setattr(events.os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    events.send_many(("comm", {"ops": 2}), ("done", {"failed": False, "gpu_mem": None}))
    events.send_many()  # nothing to send: nothing written
    assert len(writes) == 1  # one wake of the reader (the kernel) for both
    lines = os.read(read_end, 1 << 16).decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"kind": "comm", "ops": 2}, {"kind": "done", "failed": False, "gpu_mem": None}]


def test_a_line_bigger_than_the_pipe_arrives_whole():
    """A 4 MiB line is far more than a pipe holds (64 KiB): written in parts as the reader
    drains it, never cut short."""
    big = "x" * (4 << 20)

    def body() -> int:
        events.send("display", data={"text/plain": big})
        return 0

    run = run_with_events(body)
    assert run.code == 0, run.stderr
    assert run.events == [{"kind": "display", "data": {"text/plain": big}}]


def test_lines_sent_from_several_threads_never_interleave():
    """Big lines from four threads at once: each arrives whole (a lock holds a line's parts
    together), and every one arrives."""
    def body() -> int:
        def sender(t: int) -> None:
            for i in range(10):
                events.send("figure", thread=t, i=i, pad="y" * 200_000)

        threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return 0

    run = run_with_events(body)
    assert run.code == 0, run.stderr
    assert sorted((e["thread"], e["i"]) for e in run.events) == [(t, i) for t in range(4) for i in range(10)]
    assert all(e["pad"] == "y" * 200_000 for e in run.events)
    for t in range(4):  # one thread's lines in the order it sent them
        assert [e["i"] for e in run.events if e["thread"] == t] == list(range(10))
