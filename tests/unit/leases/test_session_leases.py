"""A session leases this machine's GPUs for each CUDA job (taas.session with taas.leases):
the ranks get the leased GPUs as CUDA_VISIBLE_DEVICES and the lease's files as shared fds,
the lease goes when the cell ends, --no-wait fails at once starting nothing, a cell waits
with its line until the holder is gone, and %taas lists the GPUs.  Fake GPUs and a launcher
double (no process, no GPU)."""

from __future__ import annotations

import os
import signal

import pytest

from taas import directive, status
from taas.errors import LaunchError
from taas.launch.api import ProcessExit
from taas.leases import locks
from taas.leases.api import Holder
from taas.leases.inventory import fake
from taas.session import Session
from tests.support.forks import exit_code, fork, no_leftover_children  # noqa: F401 (autouse)
from tests.support.scripted import OneMachine, ScriptedHandle, Sink


class TwoGpus(OneMachine):
    """A machine with two (fake) GPUs whose processes all exit 0 at once; what the lock
    directory held when each job started is kept."""

    def __init__(self, path: str):
        self.path, self.specs, self.held = path, [], []

    def cuda_devices(self):
        return 2

    def start(self, spec):
        self.specs.append(spec)
        self.held.append(locks.held(self.path))
        return ScriptedHandle(spec, [ProcessExit(p.key, 0, 0) for p in spec.processes])


class Waiting(Sink):
    def __init__(self, on_wait=None):
        super().__init__()
        self.lines: list[tuple[str, bool]] = []
        self.on_wait = on_wait

    def progress(self, key, stream, text, final):
        assert key == "taas:gpus" and stream == "stderr"
        self.lines.append((text, final))
        if not final and self.on_wait is not None:
            self.on_wait()


@pytest.fixture
def machine(tmp_path, monkeypatch):
    path = str(tmp_path / "leases")
    monkeypatch.setenv(locks.ENV, path)
    launcher = TwoGpus(path)
    session = Session(launcher)
    session.gpus = lambda: fake("GPU-a,GPU-b")
    yield launcher, session
    session.close()


def run(session, argline: str, sink=None):
    return session.run_cell("x = 1", {}, directive.parse_options(argline), sink=sink or Sink())


def hold(path: str, uuids) -> int:
    ready_r, ready_w = os.pipe()

    def body() -> int:
        locks.ensure(path)
        lease = locks.try_take(path, uuids, Holder("otherjob", "bob", 1.0, "other.ipynb"))
        os.write(ready_w, b"1" if lease is not None else b"0")
        signal.pause()  # holding it (a dropped Lease would let go)
        return 0

    pid = fork(body)
    assert os.read(ready_r, 1) == b"1"  # the event: it holds them
    return pid


def test_the_ranks_get_the_leased_gpus_and_the_lease_goes_with_the_cell(machine):
    launcher, session = machine
    run(session, "--gpus 2")
    spec = launcher.specs[0]
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b" for p in spec.processes)
    assert len(spec.shared_fds) >= 2  # the lease's files travel to every process
    held = launcher.held[0]
    assert set(held) == {"GPU-a", "GPU-b"} and held["GPU-a"].job == session.last.job_id
    assert locks.held(launcher.path) == {}  # the cell ended: nothing holds them


def test_a_job_takes_the_free_gpu_beside_a_held_one(machine):
    launcher, session = machine
    pid = hold(launcher.path, ["GPU-a"])
    run(session, "--gpus 1")
    assert launcher.specs[0].processes[0].env["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    os.kill(pid, signal.SIGKILL)
    exit_code(pid)


def test_no_wait_is_one_line_naming_the_holder_and_starts_nothing(machine):
    launcher, session = machine
    pid = hold(launcher.path, ["GPU-a", "GPU-b"])
    with pytest.raises(LaunchError) as error:
        run(session, "--gpus 1 --no-wait")
    text = str(error.value)
    assert text.startswith("--no-wait: 1 GPU(s) asked, 0 free: GPU 0 leased by job otherjob (bob, since ")
    assert "other.ipynb" in text and "\n" not in text
    assert launcher.specs == []
    os.kill(pid, signal.SIGKILL)
    exit_code(pid)


def test_a_cell_waits_with_its_line_then_runs_when_the_holder_dies(machine):
    launcher, session = machine
    pid = hold(launcher.path, ["GPU-b"])

    def holder_dies():
        if launcher.specs == [] and pid in alive:
            alive.remove(pid)
            assert launcher.specs == []  # waiting: nothing started yet
            os.kill(pid, signal.SIGKILL)
            exit_code(pid)

    alive = [pid]
    sink = Waiting(holder_dies)
    run(session, "--gpus 2", sink)
    first, final = sink.lines[0]
    assert not final and first.startswith("taas: waiting for 2 GPU(s), 1 free: GPU 1 leased by job otherjob")
    assert sink.lines[-1][1] and sink.lines[-1][0].startswith("taas: waited ")
    assert launcher.specs[0].processes[1].env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


def test_taas_status_lists_the_gpus_free_and_leased(machine):
    launcher, session = machine
    pid = hold(launcher.path, ["GPU-b"])
    text = status.render(session)
    assert "GPUs on this machine (leases in " in text
    assert "  GPU 0 GPU-a: free" in text
    assert "  GPU 1 GPU-b: leased by job otherjob (bob, since " in text
    os.kill(pid, signal.SIGKILL)
    exit_code(pid)
