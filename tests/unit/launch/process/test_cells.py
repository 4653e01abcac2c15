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


def test_a_cell_goes_to_every_rank_or_to_none_and_a_gone_rank_is_seen_at_once(tmp_path):
    job = str(tmp_path)
    inboxes = [cells.Inbox(job, f"rank{r}") for r in range(3)]
    try:
        assert cells.unreachable(job, ["rank0", "rank1", "rank2"]) is None
        assert sorted(os.listdir(tmp_path / cells.FIFO_DIR)) == ["rank0", "rank1", "rank2"]  # no temporary names left
        os.close(inboxes[1].fd)  # rank 1 died: its FIFO has no reader, before anyone reports its exit
        why = cells.unreachable(job, ["rank0", "rank1", "rank2"])
        assert why is not None and why.filename == "rank1"
        with pytest.raises(OSError) as info:
            cells.send_all(job, ["rank0", "rank1", "rank2"], cells.NextCell("p.pkl", "r.pkl"))
        assert info.value.filename == "rank1"
        cells.send_all(job, ["rank0", "rank2"], cells.Release())
        assert inboxes[0].next() == cells.Release() and inboxes[2].next() == cells.Release()  # not the refused cell
    finally:
        for inbox in (inboxes[0], inboxes[2]):
            os.close(inbox.fd)


def test_a_process_whose_main_thread_ended_is_ending_though_it_still_runs(tmp_path):
    """What a SIGKILLed many-threaded rank looks like for a moment: a zombie leader whose other
    threads still run (and hold its FIFO).  A live process is not ending; a reaped one is."""
    import subprocess
    import sys
    import time

    import psutil

    code = ("import ctypes, threading, time\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    leader_gone = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(leader_gone.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert leader_gone.poll() is None  # the process is still there: not reaped, not reapable
        assert cells.ending({"rank0": live.pid}) is None
        assert cells.ending({"rank0": live.pid, "rank1": leader_gone.pid}) == "rank1 ended"
    finally:
        for process in (live, leader_gone):
            process.kill()
            process.wait()
    assert cells.ending({"rank0": live.pid}) == "rank0 ended"


def test_a_process_state_is_read_whatever_its_name():
    """The state letter follows the last ")" of /proc/PID/stat: a name may hold both."""
    import subprocess
    import sys

    named = ("import sys, time\n"
             "open('/proc/self/comm', 'w').write('a) b (Z) c')\n"  # a process may name itself so
             "print('named', flush=True)\n"
             "time.sleep(600)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", named], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline() == "named\n"
        with open(f"/proc/{sleeper.pid}/stat") as stat:
            assert "(a) b (Z) c)" in stat.read()
        assert cells._state(sleeper.pid) in ("S", "R")
        assert cells.ending({"rank0": sleeper.pid}) is None
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()
    assert cells._state(sleeper.pid) is None
