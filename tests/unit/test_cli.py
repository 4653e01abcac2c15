"""The ``taas`` console script (taas/cli.py), run for real in a pseudo-terminal as a person would
run it, over records made here with Store and LogWriter (TAAS_HOME: a tmp folder).

A running job is a process of the test's own that plays its host: it holds the record's lock,
writes its pid and start time into the record, and on SIGTERM writes the record ``cancelled``
and exits.  Every process started here is killed by its pid at the test's end.

pexpect comes with IPython (its terminal's dependency on Linux); not a dependency of its own."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from taas.jobs import api
from taas.jobs.api import JobRecord, State
from taas.jobs.log import LogWriter, write_view
from taas.jobs.store import Store
from tests.support.processes import is_alive, wait_for
from tests.support.jobs import make_record

pexpect = pytest.importorskip("pexpect", reason="pexpect (IPython's dependency) drives the pseudo-terminal")

TAAS = pathlib.Path(sys.executable).with_name("taas")

HOST = r"""
import pathlib, signal, sys, time
import psutil
from taas.jobs.api import State
from taas.jobs.store import Store, hold_lock
folder = pathlib.Path(sys.argv[1])
store = Store(folder.parent)
hold_lock(folder)
me = psutil.Process()
record = store.read(folder.name).replace(state=State.RUNNING, host_pid=me.pid, host_started=me.create_time())
store.write(record)

def cancelled(signum, frame):
    store.write(record.replace(state=State.CANCELLED, ended=time.time(), cause="cancelled"))
    sys.exit(0)

signal.signal(signal.SIGTERM, cancelled)
print("running", flush=True)
while True:
    signal.pause()
"""


def record(job_id: str, state: State = State.DONE, **changes) -> JobRecord:
    return make_record(job_id, state, age=120, took=90, **changes)


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("TAAS_JOBS_MAX_AGE", "TAAS_LOG_CAP"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home"


@pytest.fixture
def store(home):
    return Store(home / "jobs")


@pytest.fixture
def hosts():
    """``start(folder)``: a process playing the job's host, once it holds the lock and wrote its
    pid (its Popen); reaped as soon as it ends (cancel waits for its pid to go), and killed by
    its pid at the test's end if it is still there."""
    started: list[subprocess.Popen] = []

    def start(folder: pathlib.Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOST, str(folder)], stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline() == "running\n"  # an event: the lock is held, the pid written
        threading.Thread(target=process.wait, daemon=True).start()
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


def spawn(home: pathlib.Path, *args: str):
    env = dict(os.environ, TAAS_HOME=str(home), TERM="xterm")
    return pexpect.spawn(str(TAAS), list(args), env=env, encoding="utf-8", codec_errors="replace",
                         dimensions=(50, 250), timeout=60)


def taas(home: pathlib.Path, *args: str) -> tuple[int, str]:
    """Run ``taas ARGS`` to its end: its exit status and what the terminal showed (\\n lines)."""
    child = spawn(home, *args)
    child.expect(pexpect.EOF)
    shown = child.before
    child.close()
    assert child.signalstatus is None
    return child.exitstatus, shown.replace("\r\n", "\n")


def one_line(shown: str) -> str:
    lines = shown.strip("\n").split("\n")
    assert len(lines) == 1, shown
    return lines[0]


def logged(folder: pathlib.Path, *texts: str, cap: int = 1 << 20) -> LogWriter:
    out = LogWriter(folder, cap=cap)
    for text in texts:
        out.append({"op": "w", "s": "stdout", "x": text})
    return out


# -- taas jobs -----------------------------------------------------------------------------------
def test_jobs_with_none(home):
    status, shown = taas(home, "jobs")
    assert status == 0
    assert one_line(shown) == "taas: no jobs (a cell run with --detach starts one)"


def test_jobs_lists_this_machines_gpus_free_and_leased(home, tmp_path, monkeypatch):
    from taas.leases import locks
    from taas.leases.api import Holder

    monkeypatch.setenv("TAAS_FAKE_GPUS", "GPU-a,GPU-b:9000,GPU-c")  # NVML's list, faked
    monkeypatch.setenv(locks.ENV, str(tmp_path / "leases"))
    locks.ensure(str(tmp_path / "leases"))
    lease = locks.try_take(str(tmp_path / "leases"), ["GPU-c"], Holder("ab12cd34ef56", "alice", 1.0, "nb.ipynb"))
    status, shown = taas(home, "jobs")
    lease.close()
    assert status == 0
    lines = shown.strip("\n").split("\n")
    assert lines[0] == "taas: no jobs (a cell run with --detach starts one)"
    assert lines[1] == f"GPUs on this machine (leases in {tmp_path / 'leases'}):"
    assert lines[2:4] == ["  GPU 0 GPU-a: free", "  GPU 1 GPU-b: busy outside taas (8.8 GiB used)"]
    assert lines[4].startswith("  GPU 2 GPU-c: leased by job ab12cd34ef56 (alice, since ")
    assert lines[4].endswith(", nb.ipynb)") and len(lines) == 5


def test_jobs_lists_each_job_newest_first_with_causes_below(home, store, hosts):
    now = time.time()
    store.create(record("aaa111", State.DONE, started=now - 3000, has_results=True, first_line="x = train()"))
    store.create(record("bbb222", State.FAILED, started=now - 2000, cause="RuntimeError: CUDA out of memory"))
    hosts(store.create(record("ccc333", State.WAITING, started=now - 1000, notebook="eval.ipynb", ended=None)))
    store.create(record("ddd444", State.CANCELLED, started=now - 500, cause="cancelled"))
    status, shown = taas(home, "jobs")
    assert status == 0
    lines = shown.rstrip("\n").split("\n")
    assert lines[0].split() == ["ID", "STATE", "RANKS", "WHERE", "STARTED", "TIME", "SIZE", "NOTEBOOK", "CELL"]
    assert [line.split()[0] for line in lines[1:5]] == ["ddd444", "ccc333", "bbb222", "aaa111"]
    state = lines[0].index("STATE")
    assert [line[state:].split("  ")[0] for line in lines[1:5]] == [
        "cancelled", "running", "failed", "done (results waiting)"]
    assert "eval.ipynb" in lines[2] and "x = train()" in lines[4]
    assert lines[5:] == ["bbb222 failed: RuntimeError: CUDA out of memory"]


def test_a_job_whose_host_was_killed_reads_lost_with_its_cause(home, store, hosts):
    host = hosts(store.create(record("abc123", State.RUNNING, ended=None)))
    status, shown = taas(home, "jobs")
    assert status == 0 and " running " in shown.split("\n")[1]
    os.kill(host.pid, signal.SIGKILL)
    wait_for(lambda: not is_alive(host.pid), timeout=30, what="the killed host's end")
    status, shown = taas(home, "jobs")
    assert status == 0
    lines = shown.rstrip("\n").split("\n")
    assert lines[1].split()[:2] == ["abc123", "lost"]
    assert lines[2] == (f"abc123 lost: its supervisor (pid {host.pid}) ended without a word: killed, or the "
                        "machine restarted; its ranks ended with it")
    assert json.loads((store.folder("abc123") / api.RECORD).read_text())["state"] == "lost"


def test_jobs_with_a_damaged_record_lists_the_others(home, store):
    store.create(record("aaa111"))
    store.create(record("bad000"))
    (store.folder("bad000") / api.RECORD).write_text('{"id": "bad0')
    status, shown = taas(home, "jobs")
    assert status == 0
    lines = shown.rstrip("\n").split("\n")
    assert {line.split()[0]: line.split()[1] for line in lines[1:3]} == {"aaa111": "done", "bad000": "unreadable"}
    assert lines[3].startswith("bad000: taas: job bad000's record is damaged (JSONDecodeError")


def test_a_records_folder_others_can_read_is_one_line_naming_chmod(home, store):
    store.create(record("aaa111"))
    os.chmod(store.root, 0o755)
    status, shown = taas(home, "jobs")
    assert status == 2
    assert one_line(shown) == (f"taas: the job records folder {store.root} can be read by others (mode 755); "
                               f"run: chmod 700 {store.root}")


# -- taas logs / forget ------------------------------------------------------------------------------
def test_logs_prints_the_whole_output(home, store):
    folder = store.create(record("abc123"))
    out = logged(folder, "epoch 1: loss 0.9\n", "epoch 2: loss 0.5\n")
    out.append({"op": "p", "k": "bar0", "s": "stderr", "x": "100%|██████████| 2/2"})
    out.append({"op": "w", "s": "stderr", "x": "saved model.pt\n"})
    out.close()
    status, shown = taas(home, "logs", "abc")
    assert status == 0
    assert shown == "epoch 1: loss 0.9\nepoch 2: loss 0.5\n100%|██████████| 2/2\nsaved model.pt\n"


def test_logs_of_a_log_past_its_cap_says_what_was_dropped(home, store):
    folder = store.create(record("abc123"))
    logged(folder, *(f"line {n:04d}\n" for n in range(400)), cap=4096).close()
    status, shown = taas(home, "logs", "abc123")
    assert status == 0
    lines = shown.rstrip("\n").split("\n")
    [note] = [line for line in lines if not line.startswith("line ")]
    assert note.startswith("taas: ") and "output records dropped here" in note and "TAAS_LOG_CAP" in note
    assert lines[0] == "line 0000" and lines[-1] == "line 0399"
    assert int(note.split()[1].replace(",", "")) == 400 - (len(lines) - 1)


def test_logs_follow_until_the_job_is_cancelled(home, store, hosts):
    folder = store.create(record("abc123", State.WAITING, ended=None))
    out = logged(folder, "step 1\n")
    host = hosts(folder)
    child = spawn(home, "logs", "-f", "abc123")
    try:
        child.expect_exact("step 1\r\n")
        out.append({"op": "w", "s": "stdout", "x": "step 2\n"})
        child.expect_exact("step 2\r\n")
        host.send_signal(signal.SIGTERM)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 1
        assert one_line(child.before.replace("\r\n", "\n")) == "taas: job abc123 was cancelled; nothing came back"
    finally:
        out.close()
        child.close(force=True)


def test_forget_drops_a_finished_job(home, store):
    store.create(record("abc123"))
    store.create(record("def456"))
    status, shown = taas(home, "forget", "abc")
    assert status == 0
    assert one_line(shown) == "taas: job abc123 forgotten"
    assert store.ids() == ["def456"]


def test_forget_refuses_a_running_job(home, store, hosts):
    host = hosts(store.create(record("abc123", State.WAITING, ended=None)))
    status, shown = taas(home, "forget", "abc123")
    assert status == 2
    assert one_line(shown) == "taas: job abc123 is running; `taas cancel abc123` first, then forget it"
    assert store.read("abc123").state is State.RUNNING and host.poll() is None


# -- ids a person may type -------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["logs", "attach", "cancel", "forget"])
@pytest.mark.parametrize("typed, says", [
    ("fff", "taas: no job 'fff' here; `taas jobs` lists yours"),
    ("zz-top", "taas: 'zz-top' is not a job id (ids look like 7f3a2c); `taas jobs` lists yours"),
    ("ab", "taas: 'ab' names 2 jobs (abc123, abd456); type more of the id"),
])
def test_a_bad_id_is_one_line_and_exit_2(home, store, verb, typed, says):
    store.create(record("abc123"))
    store.create(record("abd456"))
    status, shown = taas(home, verb, typed)
    assert status == 2
    assert one_line(shown) == says
    assert store.ids() == ["abc123", "abd456"]


def test_an_id_on_an_empty_machine(home):
    status, shown = taas(home, "logs", "abc123")
    assert status == 2
    assert one_line(shown) == "taas: no job 'abc123' here; `taas jobs` lists yours"


# -- taas cancel -----------------------------------------------------------------------------------
@pytest.mark.parametrize("state", [State.DONE, State.FAILED, State.CANCELLED])
def test_cancel_of_a_finished_job_is_one_line(home, store, state):
    store.create(record("abc123", state))
    status, shown = taas(home, "cancel", "abc123")
    assert status == 2
    assert one_line(shown) == f"taas: job abc123 already ended ({state.value}); nothing to cancel"


def test_cancel_ends_a_running_job_and_prints_its_state(home, store, hosts):
    host = hosts(store.create(record("abc123", State.WAITING, ended=None)))
    assert store.read("abc123").state is State.RUNNING
    status, shown = taas(home, "cancel", "abc")
    assert status == 0
    assert one_line(shown) == "taas: job abc123 cancelled"
    assert host.wait(timeout=30) == 0  # ended by its SIGTERM handler, not killed
    assert store.read("abc123").state is State.CANCELLED


# -- taas attach -----------------------------------------------------------------------------------
def test_attach_shows_output_as_it_comes_and_ctrl_c_leaves_the_job_running(home, store, hosts):
    folder = store.create(record("abc123", State.WAITING, ended=None))
    out = logged(folder, "loading data\n", "epoch 1\n")
    write_view(folder, {"progress": {}, "panel": {"data": {"text/plain": "rank 0: epoch 1 step 40"}, "md": {}},
                        "live": {}, "at": 1.0})
    host = hosts(folder)
    child = spawn(home, "attach", "abc")
    try:
        child.expect_exact("loading data\r\nepoch 1\r\n")
        child.expect_exact("rank 0: epoch 1 step 40")  # the rank panel, in place below the output
        out.append({"op": "w", "s": "stdout", "x": "epoch 2 written meanwhile\n"})
        child.expect_exact("epoch 2 written meanwhile")
        child.sendcontrol("c")
        child.expect(pexpect.EOF)
        child.close()
        assert child.signalstatus is None and child.exitstatus == 130
        # One line says so (the terminal echoed ^C; the panel was erased and drawn again).
        assert re.findall(r"taas: [^\r\n]*", child.before) == [
            "taas: stopped following job abc123; it goes on (taas attach abc123)"]
    finally:
        out.close()
        child.close(force=True)
    assert host.poll() is None and is_alive(host.pid)  # the job goes on
    assert store.read("abc123").state is State.RUNNING


def test_attach_to_a_finished_job_shows_it_and_how_it_ended(home, store):
    folder = store.create(record("abc123", State.DONE, has_results=True))
    logged(folder, "trained\n").close()
    status, shown = taas(home, "attach", "abc123")
    assert status == 0
    assert shown == ("trained\ntaas: job abc123 done (rank 0's results wait for a notebook: "
                     "%taas attach abc123)\n")


def test_attach_to_kept_ranks_shows_their_cell_and_how_a_notebook_adopts_them(home, store):
    from taas.jobs.store import hold_lock

    folder = store.create(record("abc123", State.KEPT, has_results=True, keep=True))
    logged(folder, "model built\n").close()
    lock = hold_lock(folder)  # their host lives
    try:
        status, shown = taas(home, "attach", "abc123")
    finally:
        os.close(lock)
    assert status == 0
    assert shown == ("model built\ntaas: job abc123's cell ended; its kept ranks wait for a notebook: "
                     "%taas attach abc123 makes them its kept ranks (taas cancel abc123 ends them)\n")
