"""taas.host.client, the viewer's side: a Follower replays a recorded stream (written here with
the host's own LogWriter and RecordSink) onto a fake sink; results taken once; what a job that
did not succeed raises; results loaded value by value; cancel's checks."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from taas.errors import JobFailed, LaunchError
from taas.host import client, sink as sink_module
from taas.host.api import FAILURE, Failure, Returned
from taas.host.client import Follower
from taas.host.sink import RecordSink
from taas.jobs import api
from taas.jobs.api import JobRecord, State
from taas.jobs.log import LogWriter
from taas.jobs.store import JobError, Store, hold_lock, write_file
from tests.support.jobs import make_record

JOB = "a1b2c3"


class FakeSink:
    """Every call a Follower makes, in order, as tuples."""

    def __init__(self):
        self.calls: list[tuple] = []

    def write(self, stream, text):
        self.calls.append(("write", stream, text))

    def progress(self, key, stream, text, final):
        self.calls.append(("progress", key, stream, text, final))

    def display(self, data, metadata):
        self.calls.append(("display", data, metadata))

    def live(self, name, data, metadata, final):
        self.calls.append(("live", name, data, metadata, final))

    def panel(self, bundle, metadata, final):
        self.calls.append(("panel", bundle, metadata, final))

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


class WritesOnly:
    """A sink with write() only: the rest of what a job shows is left out, never an error."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def write(self, stream, text):
        self.lines.append((stream, text))


def record(state: State = State.DONE, job_id: str = JOB, **changes) -> JobRecord:
    return make_record(job_id, state, **changes)


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "jobs")


@pytest.fixture
def host(store, monkeypatch):
    """A recorded job's writing side: its folder and a RecordSink over its logs.  The sink's view
    flusher is held off (a long VIEW_EVERY): each test writes view.json when it says, with
    ``host.flush()``, so what a follower finds is the test's choice, not a timer's."""
    monkeypatch.setattr(sink_module, "VIEW_EVERY", 3600.0)
    folder = store.create(record())
    out = LogWriter(folder, cap=1 << 20)
    recorder = RecordSink(folder, out, LogWriter(folder, cap=1 << 20, part=api.METRICS))
    yield recorder
    recorder.close()
    out.close()


# -- the stream ----------------------------------------------------------------------------------
def test_lines_and_displays_in_order(store, host):
    host.write("stdout", "epoch 1\n")
    host.write("stderr", "warning: slow\n")
    host.display({"text/plain": "<Figure>", "image/png": "iVBOR"}, {"isolated": True})
    host.write("stdout", "epoch 2\n")
    fake = FakeSink()
    follower = Follower(store, JOB, fake)
    follower.step()
    assert fake.take() == [("write", "stdout", "epoch 1\n"), ("write", "stderr", "warning: slow\n"),
                           ("display", {"text/plain": "<Figure>", "image/png": "iVBOR"}, {"isolated": True}),
                           ("write", "stdout", "epoch 2\n")]
    follower.step()
    assert fake.take() == []  # each record once
    host.write("stdout", "epoch 3\n")
    follower.step()
    assert fake.take() == [("write", "stdout", "epoch 3\n")]


def test_the_detaching_cell_skips_the_notes_it_showed_itself_whenever_they_arrive(store, host):
    host.write("stderr", "taas: a note the cell showed\n")
    fake = FakeSink()
    follower = Follower(store, JOB, fake, skip=2)
    follower.step()
    assert fake.take() == []  # one of the two is in the log so far
    host.write("stderr", "taas: the second note the cell showed\n")
    host.write("stdout", "epoch 1\n")
    follower.step()
    assert fake.take() == [("write", "stdout", "epoch 1\n")]
    fresh = FakeSink()  # any later viewer sees them all
    Follower(store, JOB, fresh).step()
    assert [call[2] for call in fresh.take()] == ["taas: a note the cell showed\n",
                                                  "taas: the second note the cell showed\n", "epoch 1\n"]


def test_a_finished_progress_bar_is_its_final_line_only(store, host):
    for done in range(0, 101, 10):
        host.progress("bar0", "stderr", f"{done}%", final=done == 100)
        host.flush()
    fake = FakeSink()
    Follower(store, JOB, fake).step()
    assert fake.take() == [("progress", "bar0", "stderr", "100%", True)]


def test_what_is_shown_in_place_is_its_latest_state_only(store, host):
    fake = FakeSink()
    follower = Follower(store, JOB, fake)
    for done in (10, 20, 30):
        host.progress("bar0", "stderr", f"{done}%", final=False)
    host.panel({"text/plain": "rank 0: step 1"}, {}, final=False)
    host.panel({"text/plain": "rank 0: step 2"}, {"w": 1}, final=False)
    host.live("loss", {"text/plain": "plot 1"}, {}, final=False)
    host.live("loss", {"text/plain": "plot 2"}, {}, final=False)
    host.flush()
    follower.step()
    assert sorted(fake.take(), key=lambda call: call[0]) == [
        ("live", "loss", {"text/plain": "plot 2"}, {}, False),
        ("panel", {"text/plain": "rank 0: step 2"}, {"w": 1}, False),
        ("progress", "bar0", "stderr", "30%", False),
    ]
    follower.step()
    assert fake.take() == []  # the view unchanged: nothing redrawn

    host.progress("bar0", "stderr", "40%", final=False)  # only the bar moved
    host.flush()
    follower.step()
    assert fake.take() == [("progress", "bar0", "stderr", "40%", False)]

    # The panel gives way to its summary line (what the board passes as final): every viewer
    # shows that, once, and a view saved before it never opens the panel again.
    host.panel({"text/plain": "taas: 2 ranks, done"}, {}, final=True)
    follower.step()
    assert fake.take() == [("panel", {"text/plain": "taas: 2 ranks, done"}, {}, True)]
    host.flush()
    follower.step()
    assert fake.take() == []

    host.live("loss", {"text/plain": "plot 3"}, {}, final=True)  # the live plot's last frame
    host.flush()
    follower.step()
    assert fake.take() == [("live", "loss", {"text/plain": "plot 3"}, {}, True)]

    follower.finish()  # the job ended with the bar open: closed at its last state
    assert fake.take() == [("progress", "bar0", "stderr", "40%", True)]


def test_an_attach_mid_job_shows_what_is_open_now(store, host):
    host.write("stdout", "started\n")
    host.progress("bar0", "stderr", "55%", final=False)
    host.progress("bar1", "stdout", "3/10", final=False)
    host.panel({"text/plain": "ranks: 2 running"}, {}, final=False)
    host.flush()
    fake = FakeSink()
    follower = Follower(store, JOB, fake)
    follower.step()
    calls = fake.take()
    assert calls[0] == ("write", "stdout", "started\n")
    assert sorted(calls[1:], key=str) == sorted([
        ("progress", "bar0", "stderr", "55%", False), ("progress", "bar1", "stdout", "3/10", False),
        ("panel", {"text/plain": "ranks: 2 running"}, {}, False)], key=str)
    follower.finish()
    assert sorted(fake.take(), key=str) == sorted([
        ("panel", {"text/plain": "ranks: 2 running"}, {}, True),
        ("progress", "bar0", "stderr", "55%", True), ("progress", "bar1", "stdout", "3/10", True)], key=str)


def test_a_bar_that_finished_after_the_last_view_is_not_reopened(store, host):
    fake = FakeSink()
    follower = Follower(store, JOB, fake)
    host.progress("bar0", "stderr", "50%", final=False)
    host.flush()
    follower.step()
    assert fake.take() == [("progress", "bar0", "stderr", "50%", False)]
    host.progress("bar0", "stderr", "60%", final=False)
    host.flush()  # the view as it was at 60% ...
    host.progress("bar0", "stderr", "100%", final=True)  # ... then the bar finished, the view not yet written
    follower.step()
    host.flush()
    follower.step()
    follower.finish()
    assert fake.take() == [("progress", "bar0", "stderr", "100%", True)]


def test_a_sink_with_write_only_gets_the_lines(store, host):
    host.write("stdout", "a\n")
    host.progress("bar0", "stderr", "100%", final=True)
    host.display({"text/plain": "x"}, {})
    host.live("loss", {"text/plain": "plot"}, {}, final=True)
    host.panel({"text/plain": "rank 0"}, {}, final=False)
    host.write("stdout", "b\n")
    host.flush()
    plain = WritesOnly()
    follower = Follower(store, JOB, plain)
    follower.step()
    follower.finish()
    assert plain.lines == [("stdout", "a\n"), ("stdout", "b\n")]


def test_metrics_rows_go_to_on_metrics_from_the_start(store, host):
    host.metrics("job-1", 0, [(1, {"loss": 0.9}), (2, {"loss": 0.8})])
    host.metrics("job-1", 1, [(1, {"loss": 1.0})])
    for n in range(50):
        host.write("stdout", f"line {n}\n")
    rows = []
    follower = Follower(store, JOB, FakeSink(), latest=5,
                        on_metrics=lambda job_id, rank, got: rows.append((job_id, rank, got)))
    follower.step()
    assert rows == [(JOB, 0, [(1, {"loss": 0.9}), (2, {"loss": 0.8})]), (JOB, 1, [(1, {"loss": 1.0})])]
    host.metrics("job-1", 0, [(3, {"loss": 0.7, "acc": 0.5})])
    follower.step()
    assert rows[2:] == [(JOB, 0, [(3, {"loss": 0.7, "acc": 0.5})])]
    follower.step()
    assert len(rows) == 3


def test_without_on_metrics_the_metrics_log_is_not_read(store, host):
    host.metrics("job-1", 0, [(1, {"loss": 0.9})])
    fake = FakeSink()
    Follower(store, JOB, fake).step()
    assert fake.take() == []


def test_a_gap_in_the_log_is_one_note(store):
    folder = store.create(record(job_id="d4e5f6"))
    out = LogWriter(folder, cap=4096)
    total = 400
    for n in range(total):
        out.append({"op": "w", "s": "stdout", "x": f"line {n:04d}\n"})
    fake = FakeSink()
    Follower(store, "d4e5f6", fake).finish()
    calls = fake.take()
    notes = [call for call in calls if call[1] == "stderr"]
    shown = [call for call in calls if call[1] == "stdout"]
    assert len(notes) == 1
    dropped = total - len(shown)
    assert notes[0] == ("write", "stderr", f"taas: {dropped:,} output records dropped here: the job's log keeps "
                        "its first and its latest output (TAAS_LOG_CAP)\n")
    at = calls.index(notes[0])
    assert calls[at - 1] == ("write", "stdout", f"line {at - 1:04d}\n")
    assert calls[at + 1] == ("write", "stdout", f"line {at + dropped:04d}\n")
    assert calls[-1] == ("write", "stdout", f"line {total - 1:04d}\n")


@pytest.mark.parametrize("latest", [100, 12])
def test_starting_near_the_end_shows_the_latest_bytes_of_whole_lines(store, host, latest):
    lines = [f"line {n}\n" for n in range(2000)]
    for line in lines:
        host.write("stdout", line)
    fake = FakeSink()
    follower = Follower(store, JOB, fake, latest=latest)
    follower.step()
    calls = fake.take()
    assert calls[0] == ("write", "stdout", f"taas: job {JOB}: earlier output not shown here "
                        f"(`taas logs {JOB}` prints it all)\n")
    shown = "".join(text for _, _, text in calls[1:])
    assert lines[-1] in shown and shown == "".join(lines)[-len(shown):]  # the end, in order
    assert len(shown) <= latest < len(shown) + len(lines[0]) + 4  # as many whole lines as fit


def test_one_huge_record_is_cut_to_its_latest_whole_lines(store, host):
    text = "".join(f"line {n}\n" for n in range(5000))
    host.write("stdout", text)  # one record, as the router writes a burst
    fake = FakeSink()
    Follower(store, JOB, fake, latest=1000).step()
    shown = "".join(call[2] for call in fake.take())
    assert shown.endswith("line 4999\n") and text.endswith(shown) and len(shown) <= 1000
    assert shown.startswith("line ")  # a whole line first


def test_starting_near_the_end_of_a_short_log_shows_it_all_without_a_note(store, host):
    for n in range(3):
        host.write("stdout", f"line {n}\n")
    fake = FakeSink()
    Follower(store, JOB, fake, latest=400).step()
    assert fake.take() == [("write", "stdout", f"line {n}\n") for n in range(3)]


def test_follow_returns_the_final_record_after_the_last_records(store, host):
    host.write("stdout", "all done\n")
    host.progress("bar0", "stderr", "7/7", final=False)
    host.flush()
    fake = FakeSink()
    final = client.follow(store, JOB, fake, latest=None)
    assert final.state is State.DONE and final.id == JOB
    assert fake.take() == [("write", "stdout", "all done\n"), ("progress", "bar0", "stderr", "7/7", False),
                           ("progress", "bar0", "stderr", "7/7", True)]


# -- results ---------------------------------------------------------------------------------------
def returned(**values) -> Returned:
    return Returned({name: pickle.dumps(value) for name, value in values.items()}, pickle.dumps(42), True)


def test_results_are_taken_once_then_a_clear_error(store):
    folder = store.create(record(has_results=True))
    write_file(folder / api.RESULTS, pickle.dumps(returned(model="weights", step=7)))
    first = client.take(store, store.read(JOB))
    assert first == returned(model="weights", step=7)
    assert not (folder / api.RESULTS).exists() and (folder / api.TAKEN).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".results")] == []
    again = store.read(JOB)
    assert again.taken is not None
    with pytest.raises(JobError) as caught:
        client.take(store, again)
    message = str(caught.value)
    assert "\n" not in message
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(again.taken))
    assert message == (f"taas: job {JOB}'s results were already taken ({when}); its output is still there: "
                       f"`taas logs {JOB}`")


def test_results_are_taken_by_one_of_many_at_once(store):
    folder = store.create(record(has_results=True))
    write_file(folder / api.RESULTS, pickle.dumps(returned(x=1)))
    takers = 8
    start = threading.Barrier(takers)
    got, refused = [], []

    def take():
        start.wait()
        try:
            got.append(client.take(store, record(has_results=True)))
        except JobError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(takers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [returned(x=1)]
    assert len(refused) == takers - 1 and all("already taken (earlier)" in text for text in refused)


def test_load_costs_only_the_value_that_cannot_be_read(store):
    values = {"a": pickle.dumps([1, 2]), "broken": b"\x80\x05not a pickle", "c": pickle.dumps("three")}
    got, out, has_out, notes = client.load(Returned(values, pickle.dumps({"out": 1}), True))
    assert got == {"a": [1, 2], "c": "three"}
    assert (out, has_out) == ({"out": 1}, True)
    assert len(notes) == 1 and notes[0].startswith("taas: `broken` could not be read back: ")
    assert "\n" not in notes[0]


def test_load_with_an_unreadable_out():
    got, out, has_out, notes = client.load(Returned({"a": pickle.dumps(1)}, b"garbage", True))
    assert got == {"a": 1} and out is None and has_out is False
    assert len(notes) == 1 and notes[0].startswith("taas: Out[] could not be read back: ")


def test_load_without_out():
    assert client.load(Returned({}, None, False)) == ({}, None, False, [])


# -- what a job that did not succeed raises ----------------------------------------------------------
def test_a_done_job_raises_nothing(store):
    store.create(record())
    assert client.raise_failure(store, store.read(JOB)) is None


def test_a_failed_job_raises_its_rendering(store):
    folder = store.create(record(State.FAILED, cause="ValueError: bad"))
    failure = Failure("ValueError: bad", ("Traceback", "  Cell In[3], line 2", "ValueError: bad"), "JobFailed")
    write_file(folder / FAILURE, json.dumps({"summary": failure.summary, "rendered": list(failure.rendered),
                                             "kind": failure.kind}).encode())
    with pytest.raises(JobFailed) as caught:
        client.raise_failure(store, store.read(JOB))
    assert caught.value.summary == "ValueError: bad"
    assert caught.value.rendered == ["Traceback", "  Cell In[3], line 2", "ValueError: bad"]


def test_a_failed_launch_raises_a_launch_error(store):
    folder = store.create(record(State.FAILED, cause="no GPU"))
    write_file(folder / FAILURE, json.dumps({"summary": "taas: --gpus 8 but 1 GPU", "rendered": [],
                                             "kind": "LaunchError"}).encode())
    with pytest.raises(LaunchError, match="--gpus 8 but 1 GPU"):
        client.raise_failure(store, store.read(JOB))


@pytest.mark.parametrize("failure_json", [None, b"{not json", b'{"summary": "x", "unknown": 1}'])
def test_a_failed_job_without_a_readable_failure_raises_its_cause(store, failure_json):
    folder = store.create(record(State.FAILED, cause="RuntimeError: NCCL timeout"))
    if failure_json is not None:
        write_file(folder / FAILURE, failure_json)
    with pytest.raises(JobFailed) as caught:
        client.raise_failure(store, store.read(JOB))
    assert str(caught.value) == f"job {JOB} failed: RuntimeError: NCCL timeout"


def test_a_cancelled_job_raises_one_line(store):
    store.create(record(State.CANCELLED, cause="cancelled"))
    with pytest.raises(JobError) as caught:
        client.raise_failure(store, store.read(JOB))
    assert str(caught.value) == f"taas: job {JOB} was cancelled; nothing came back"


def test_a_lost_job_raises_its_cause(store):
    store.create(record(State.RUNNING, ended=None, host_pid=4242))  # its lock is free: read as lost
    lost = store.read(JOB)
    assert lost.state is State.LOST
    with pytest.raises(JobError) as caught:
        client.raise_failure(store, lost)
    message = str(caught.value)
    assert message.startswith(f"taas: job {JOB} is lost: its supervisor (pid 4242) ended without a word")
    assert "\n" not in message


# -- a running copy of the same cell -----------------------------------------------------------------
def test_running_copy_finds_this_notebooks_running_job_of_the_same_cell(store):
    source = "model.fit()\n"
    running = store.folder(JOB)
    store.create(record(State.RUNNING, ended=None, source_hash=client.source_hash(source)))
    store.create(record(State.DONE, job_id="d4e5f6", source_hash=client.source_hash(source)))
    lock = hold_lock(running)  # this process plays its host: the lock held, the job runs
    try:
        found = client.running_copy(store, source, "train.ipynb")
        assert found is not None and found.id == JOB
        assert client.running_copy(store, source, "other.ipynb") is None
        assert client.running_copy(store, "model.fit(2)\n", "train.ipynb") is None
    finally:
        os.close(lock)
    assert client.running_copy(store, source, "train.ipynb") is None  # its host gone: lost, not running


def test_first_code_line_and_source_hash():
    assert client.first_code_line("\n# a comment\n   x = f(1)  \ny = 2\n") == "x = f(1)"
    assert client.first_code_line("# only\n\n") == ""
    assert client.first_code_line("z" * 200) == "z" * 80
    assert client.source_hash("a") == client.source_hash("a") != client.source_hash("b")
    assert len(client.source_hash("a")) == 16


# -- cancel's checks -------------------------------------------------------------------------------
def test_cancel_of_a_finished_job_is_one_line(store):
    store.create(record(State.DONE))
    with pytest.raises(JobError) as caught:
        client.cancel(store, JOB)
    assert str(caught.value) == f"taas: job {JOB} already ended (done); nothing to cancel"


def test_cancel_never_signals_a_process_that_only_has_the_hosts_pid(store, monkeypatch):
    monkeypatch.setattr(client, "CANCEL_GRACE", 0.2)
    bystander = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        folder = store.create(record(State.RUNNING, ended=None, host_pid=bystander.pid,
                                     host_started=1_000_000.0))  # the pid reused since the host ended
        lock = hold_lock(folder)
        try:
            final = client.cancel(store, JOB)
        finally:
            os.close(lock)
        assert final.state is State.RUNNING
        assert bystander.poll() is None  # not signalled
    finally:
        bystander.kill()
        bystander.wait()
