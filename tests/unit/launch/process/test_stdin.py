"""The stdin wire (taas.launch.process.stdin): a rank's question on the events pipe, the
kernel's answer on the rank's FIFO."""

from __future__ import annotations

import json
import os
import threading

import pytest

from taas.launch.process import stdin
from taas.launch.process.stdin import Answer


@pytest.mark.parametrize("answer", [
    Answer(1, text="Ada"), Answer(2, text=""), Answer(3, eof=True), Answer(4, error="no stdin here"),
    Answer(6, text="ünïcode \\ \"quoted\""),
])
def test_an_answer_survives_its_line(answer):
    line = answer.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert stdin.read_answer(line.rstrip(b"\n")) == answer


@pytest.mark.parametrize("line", [b"not json", b"[1]", b'{"text": "x"}', b'{"id": true, "text": "x"}',
                                  b'{"id": 1}', b'{"id": 1, "text": 5}', b"\xff"])
def test_a_line_that_is_not_an_answer_is_none(line):
    assert stdin.read_answer(line) is None


def test_a_rank_asks_on_its_events_pipe_and_reads_its_answer_skipping_others(tmp_path, monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write_end))
    monkeypatch.setattr(stdin, "_inbox", stdin._Inbox())
    stdin.setup(str(tmp_path), "rank1")
    assert stdin.answer(str(tmp_path), "rank1", Answer(1, text="x")) is False  # nobody asked yet
    got: list = []
    asker = threading.Thread(target=lambda: got.append(stdin.ask("[rank1] name? ")))
    asker.start()
    question = json.loads(os.read(read_end, 65536))
    assert question == {"kind": "ask", "id": 1, "prompt": "[rank1] name? ", "password": False,
                        "debugger": False, "post_mortem": False}
    # An answer to another question, and a line user code wrote, are skipped.
    with open(stdin.fifo_path(str(tmp_path), "rank1"), "wb") as fifo:
        fifo.write(b"garbage\n" + Answer(7, text="stale").line())
    assert stdin.answer(str(tmp_path), "rank1", Answer(1, text="Ada" * 30000))  # longer than a pipe
    asker.join(timeout=60)
    assert got == ["Ada" * 30000]
    os.close(read_end)
    os.close(write_end)


@pytest.mark.parametrize("answer, raised", [(Answer(1, eof=True), EOFError),
                                            (Answer(1, error="no box"), stdin.StdinUnavailable)])
def test_what_is_not_a_line_is_raised_in_the_rank(tmp_path, monkeypatch, answer, raised):
    read_end, write_end = os.pipe()
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write_end))
    monkeypatch.setattr(stdin, "_inbox", stdin._Inbox())
    stdin.setup(str(tmp_path), "rank0")
    stdin._inbox.open()
    assert stdin.answer(str(tmp_path), "rank0", answer)  # before the question: not lost
    with pytest.raises(raised):
        stdin.ask("? ")
    os.close(read_end)
    os.close(write_end)


def test_without_a_launcher_a_process_cannot_ask(monkeypatch):
    monkeypatch.delenv("TAAS_EVENTS_FD", raising=False)
    with pytest.raises(stdin.StdinUnavailable):
        stdin.ask("? ")
