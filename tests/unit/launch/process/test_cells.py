"""The kept ranks' cell channel: typed messages, a FIFO per rank that loses nothing."""

import os

import pytest

from taas.launch.process import cells


@pytest.mark.parametrize("message", [cells.NextCell("payload-1.pkl", "result-1.pkl"), cells.Release()])
def test_messages_round_trip(message):
    line = cells.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert cells.decode(line.strip()) == message


@pytest.mark.parametrize("line", [b"", b"not json", b"[]", b'{"kind": "cell"}', b'{"kind": "other"}',
                                  b'{"kind": "cell", "payload": "../x", "result": "r"}',
                                  b'{"kind": "cell", "payload": 1, "result": "r"}'])
def test_what_is_not_a_message_is_ignored(line):
    assert cells.decode(line) is None


def test_a_message_sent_before_the_rank_reads_arrives_and_bad_lines_are_skipped(tmp_path):
    inbox = cells.Inbox(str(tmp_path), "rank0")
    try:
        path = cells.fifo_path(str(tmp_path), "rank0")
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"garbage\n")
        os.close(fd)
        cells.send(str(tmp_path), "rank0", cells.NextCell("p.pkl", "r.pkl"))
        cells.send(str(tmp_path), "rank0", cells.Release())
        assert inbox.next() == cells.NextCell("p.pkl", "r.pkl")
        assert inbox.next() == cells.Release()
    finally:
        os.close(inbox.fd)


def test_sending_to_a_rank_that_is_not_there_fails_at_once(tmp_path):
    with pytest.raises(OSError):
        cells.send(str(tmp_path), "rank3", cells.Release())
    os.makedirs(tmp_path / cells.FIFO_DIR)
    os.mkfifo(cells.fifo_path(str(tmp_path), "rank3"))
    with pytest.raises(OSError):  # a FIFO nobody reads: ENXIO, not a hang
        cells.send(str(tmp_path), "rank3", cells.Release())
