"""taas.launch.process.stacks: where a rank's main thread is, on the kernel's request."""

from __future__ import annotations

import os
import threading
import time

import taas
from taas.launch.process import stacks
from tests.support.forks import no_leftover_children, run_with_events  # noqa: F401 (an autouse fixture)

TAAS_DIR = os.path.dirname(os.path.abspath(taas.__file__))

# A "cell": its line 4 is where it waits.
CELL = """\
import threading

def wait(flag):
    flag.wait(60)

wait(FLAG)
"""


def cell_file(tmp_path) -> str:
    path = tmp_path / "cell.py"
    path.write_text(CELL)
    return str(path)


def run_cell(path: str, flag: threading.Event) -> None:
    exec(compile(open(path).read(), path, "exec"), {"FLAG": flag})


def test_a_snapshot_starts_at_the_cell_and_names_its_innermost_line(tmp_path):
    path = cell_file(tmp_path)
    flag = threading.Event()
    thread = threading.Thread(target=run_cell, args=(path, flag))
    thread.start()
    try:
        snap = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the cell is in its wait
            snap = stacks.snapshot(thread.ident, path)
            if snap["line"] == 4:
                break
            time.sleep(0.01)
    finally:
        flag.set()
        thread.join()
    assert snap["line"] == 4 and snap["call"] == "flag.wait(60)", snap
    frames = snap["frames"]
    assert (frames[0]["filename"], frames[0]["lineno"], frames[0]["line"]) == (path, 6, "wait(FLAG)")
    assert [f["name"] for f in frames[:2]] == ["<module>", "wait"]  # what ran the cell is cut off
    assert frames[-1]["filename"] == threading.__file__  # below the cell: the library it called
    assert not any(f["filename"].startswith(TAAS_DIR + os.sep) for f in frames)


def test_a_thread_outside_the_cell_has_no_line(tmp_path):
    snap = stacks.snapshot(threading.get_ident(), str(tmp_path / "cell.py"))
    assert snap["line"] is None and snap["call"] == ""
    assert snap["frames"][-1]["name"] == "test_a_thread_outside_the_cell_has_no_line"
    assert not any(f["filename"].startswith(TAAS_DIR + os.sep) for f in snap["frames"])  # snapshot's own
    assert stacks.snapshot(-1, "x")["frames"] == []  # a thread that is gone


def test_nobody_is_asked_where_nobody_listens(tmp_path):
    assert stacks.request(str(tmp_path), ["rank0"]) == []  # no FIFO at all
    os.makedirs(os.path.dirname(stacks.fifo_path(str(tmp_path), "rank1")))
    os.mkfifo(stacks.fifo_path(str(tmp_path), "rank1"))
    assert stacks.request(str(tmp_path), ["rank1"]) == []  # a FIFO nobody reads: never blocks


def test_a_rank_answers_each_request_with_its_stack_on_the_events_pipe(tmp_path):
    """A rank (a forked child) whose main thread waits in the cell; the kernel's side asks
    twice and gets two answers, each saying the cell's line; the rank is never disturbed."""
    job_dir, path, done = str(tmp_path), cell_file(tmp_path), tmp_path / "done"
    waiting = tmp_path / "waiting"  # the rank's main thread is in the cell's flag.wait
    answers = 2

    def rank() -> int:
        stacks.start(job_dir, "rank0", path)

        class Flag:  # the cell waits on this: it ends once the kernel saw both answers
            def wait(self, timeout):
                waiting.touch()
                deadline = time.monotonic() + timeout
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)

        exec(compile(open(path).read(), path, "exec"), {"FLAG": Flag()})
        return 0 if done.exists() else 1

    def kernel() -> None:
        asked = 0
        deadline = time.monotonic() + 60
        while asked < answers and time.monotonic() < deadline:
            # Asked before the rank is in the cell, it would answer where it is then (still
            # setting up): wait for the event first.
            if waiting.exists() and stacks.request(job_dir, ["rank0", "rank1"]) == ["rank0"]:  # rank1 has no FIFO
                asked += 1
                time.sleep(0.3)  # one request a time: the rank reads one byte, answers once
            else:
                time.sleep(0.01)
        time.sleep(0.5)
        done.touch()

    asker = threading.Thread(target=kernel)
    asker.start()
    run = run_with_events(rank)
    asker.join()
    assert run.code == 0, run.stderr
    assert [e["kind"] for e in run.events] == ["stack"] * answers, run.events
    for event in run.events:  # the cell's innermost line, though the thread is deeper (in Flag.wait)
        assert (event["line"], event["call"]) == (4, "flag.wait(60)"), event
        assert event["frames"][0]["filename"] == path and event["frames"][0]["lineno"] == 6
        # deeper than the cell, in Flag.wait (or what it calls: it was once sampled in Path.stat)
        assert any(f["name"] == "wait" and f["filename"] == __file__ for f in event["frames"][1:]), event
