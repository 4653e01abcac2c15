"""A rank's heartbeat (taas.rank.heartbeat): where the main thread is, and the beats it sends."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time

import pytest

from taas.rank import heartbeat

CELL = "<taas cell 7>"


def _in_thread(source: str, namespace: dict):
    """Run ``source`` (as the cell, file CELL) in a thread until it sets ``stop``; the thread and
    a way to end it."""
    stop = threading.Event()
    ready = threading.Event()
    namespace.update(stop=stop, ready=ready)
    code = compile(source, CELL, "exec")
    thread = threading.Thread(target=exec, args=(code, namespace), daemon=True)
    thread.start()
    assert ready.wait(5)
    return thread, stop


def test_running_in_a_function_the_cell_called():
    source = "def train_step():\n    ready.set()\n    stop.wait(5)\n\n\ntrain_step()\n"
    thread, stop = _in_thread(source, {})
    try:
        state, line, call = heartbeat.where(thread.ident, CELL)
    finally:
        stop.set()
        thread.join()
    assert (state, call) == ("running", "train_step")
    assert line == 3  # the innermost line of the cell: inside train_step


def test_at_the_cells_top_level_the_call_is_blank():
    thread, stop = _in_thread("ready.set()\nstop.wait(5)\n", {})
    try:
        assert heartbeat.where(thread.ident, CELL) == ("running", 2, "wait")  # Event.wait (threading)
    finally:
        stop.set()
        thread.join()


def test_waiting_in_a_torch_distributed_call(tmp_path):
    # A module whose file lies under torch/distributed/ stands for the collective (no process group).
    folder = tmp_path / "torch" / "distributed"
    folder.mkdir(parents=True)
    (folder / "c10d_logger.py").write_text(  # torch's decorator around each collective
        "def wrapper(func, *args):\n    return func(*args)\n")
    (folder / "distributed_c10d.py").write_text(
        "def all_reduce(ready, stop):\n    return _wait(ready, stop)\n\n"
        "def _wait(ready, stop):\n    ready.set()\n    stop.wait(5)\n")
    logger = importlib.util.spec_from_file_location("fake_logger", folder / "c10d_logger.py")
    wrap = importlib.util.module_from_spec(logger)
    logger.loader.exec_module(wrap)
    spec = importlib.util.spec_from_file_location("fake_c10d", folder / "distributed_c10d.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    thread, stop = _in_thread("x = 1\nwrap.wrapper(c10d.all_reduce, ready, stop)\n",
                              {"c10d": module, "wrap": wrap})
    try:
        assert heartbeat.where(thread.ident, CELL) == ("waiting", 2, "all_reduce")  # the user's call
    finally:
        stop.set()
        thread.join()


def test_a_sample_on_cpu_has_no_gpu_figures():
    sample = heartbeat.Sampler(threading.get_ident(), CELL, "cpu").sample()
    assert sample["state"] == "starting"  # the cell has not started (heartbeat.running)
    assert sample["rss"] > 0 and sample["cpu"] >= 0
    assert sample["gpu_mem"] is None and sample["gpu_util"] is None
    assert sample["line"] is None and sample["data"] == {}


@pytest.fixture
def events_pipe(monkeypatch):
    read, write = os.pipe()
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write))
    os.set_blocking(read, False)
    yield read
    heartbeat.stop()
    os.close(read)
    os.close(write)


def _beats(fd: int) -> list[dict]:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return [json.loads(line) for line in data.decode().splitlines()]


def _wait_for_beats(fd: int, until, timeout: float = 30.0) -> list[dict]:
    """Beats read from ``fd`` until ``until(beats)`` holds (the test waits for events)."""
    beats: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(beats):
        assert time.monotonic() < deadline, beats
        beats += _beats(fd)
        time.sleep(0.01)
    return beats


def test_it_beats_from_one_interval_in_then_every_interval_and_stops(events_pipe, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.05)
    heartbeat.start(CELL, "cpu")
    first = _wait_for_beats(events_pipe, lambda beats: beats)
    assert [b["kind"] for b in first] == ["beat"] and first[0]["state"] == "starting"
    heartbeat.running()
    later = _wait_for_beats(events_pipe, lambda beats: len(beats) >= 2 and beats[-1]["state"] == "running")
    heartbeat.stop()
    time.sleep(0.1)
    _beats(events_pipe)
    time.sleep(0.15)
    assert _beats(events_pipe) == []  # no beat after stop
    from taas.supervisor import events

    assert isinstance(events.read(json.dumps(later[-1])), events.Beat)  # what the kernel reads


def test_a_cell_shorter_than_an_interval_never_samples(events_pipe, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL", 5.0)
    made = []
    monkeypatch.setattr(heartbeat, "Sampler", lambda *args: made.append(args))
    heartbeat.start(CELL, "cpu")
    heartbeat.stop()  # the cell ended before the first beat was due
    time.sleep(0.1)
    assert made == [] and _beats(events_pipe) == []


def _beaters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "taas-heartbeat" and t.is_alive()]


def test_a_kept_rank_beats_per_cell_and_nothing_between_cells(events_pipe, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.05)
    heartbeat.start(CELL, "cpu")
    heartbeat.running()
    _wait_for_beats(events_pipe, lambda beats: beats)
    first = _beaters()
    assert len(first) == 1
    heartbeat.stop()  # the kept cell is over
    _beats(events_pipe)  # what was sent before stop returned
    time.sleep(0.15)  # three intervals between cells
    assert _beats(events_pipe) == []  # nothing after stop
    heartbeat.start("<taas cell 8>", "cpu")  # the next kept cell
    heartbeat.start("<taas cell 9>", "cpu")  # a start without a stop ends the earlier cell's beats too
    heartbeat.running()
    beats = _wait_for_beats(events_pipe, lambda beats: beats and beats[-1]["state"] == "running")
    assert all(b["kind"] == "beat" for b in beats)
    assert _beaters() == first  # one thread serves every cell: no thread started per cell
    heartbeat.stop()


def test_a_forked_process_beats_with_a_thread_of_its_own(events_pipe, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.05)
    heartbeat.start(CELL, "cpu")  # the parent's thread runs
    heartbeat.stop()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a start must still beat
        beat = False
        try:
            heartbeat.start(CELL, "cpu")
            deadline = time.monotonic() + 30
            while not beat and time.monotonic() < deadline:
                beat = bool(_beats(events_pipe))
                time.sleep(0.01)
        finally:
            os._exit(0 if beat else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_cells_start_wakes_the_beating_thread_only_when_it_is_idle(events_pipe, monkeypatch):
    """Kept cells back to back: the thread, waiting for a beat that is due, is not woken by the
    next cell's start (it takes that cell when the beat is due, before the cell's own first);
    a thread idle between cells is."""
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.2)
    real, puts = heartbeat._beater, []

    class Counting:
        def __init__(self, cells):
            self.cells = cells

        def put(self, cell):
            puts.append(cell)
            self.cells.put(cell)

    monkeypatch.setattr(heartbeat, "_beater", lambda: Counting(real()))
    heartbeat.start("<taas cell 10>", "cpu")
    handed = len(puts)  # 1 if the thread was idle, 0 if it still waited for an earlier cell's beat
    heartbeat.start("<taas cell 11>", "cpu")  # the next cell, at once: the thread is not idle
    assert len(puts) == handed
    heartbeat.running()
    _wait_for_beats(events_pipe, lambda beats: beats and beats[-1]["state"] == "running")  # it beats for it
    heartbeat.stop()
    deadline = time.monotonic() + 30
    while not heartbeat._idle:  # its beat comes due, the cell is over: it waits, idle
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _beats(events_pipe)
    heartbeat.start("<taas cell 12>", "cpu")
    assert len(puts) == handed + 1  # idle: woken with the cell
    _wait_for_beats(events_pipe, lambda beats: beats)
