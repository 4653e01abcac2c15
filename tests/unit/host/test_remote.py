"""Attached jobs in the kernel's job host (taas.host.serve, taas.host.remote).

The kernel's side first, against a recorded stream of the host's frames (no processes): each
frame lands where it belongs, an input box is answered, the failure comes back as the notebook
shows it.  Then real processes: a job's output, values and failure through the host; ranks
that are the host's; an interrupt; a killed "kernel" takes its host and ranks with it."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from taas import directive
from taas.errors import JobFailed
from taas.host import channel
from taas.host.api import Answer, Ask, CellFailed, Interrupt, JobDone, Metrics, RunJob, Show
from taas.host.remote import KernelHost, RemoteSupervisor
from taas.job.api import Job, Policy, World
from taas.session import Session
from taas.supervisor.machine import State
from taas.supervisor.supervisor import Outcome
from tests.support.processes import wait_for
from tests.support.sinks import Recorder


class _Asking(Recorder):
    def __init__(self, answer):
        super().__init__()
        self.answer = answer
        self.asked: list = []

    def ask(self, prompt, password=False):
        self.asked.append((prompt, password))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class _Recorded:
    """A 'host' that plays recorded frames to the kernel's side and records what it answers."""

    inline_fds = False

    def __init__(self, frames):
        self.sock, self.theirs = socket.socketpair()
        self.frames = frames
        self.received: list = []
        self.thread = threading.Thread(target=self._play, daemon=True)
        self.thread.start()

    def fresh_sources(self):
        return {"<cell 5>": (9, None, ["def f():\n", "    pass\n"], "<cell 5>")}

    def _play(self):
        run, body = channel.recv(self.theirs)
        self.received.append(run)
        for message, body in self.frames:
            channel.send(self.theirs, message, body)
            if isinstance(message, Ask):
                self.received.append(channel.recv(self.theirs)[0])


def _job() -> Job:
    from taas.job.package import Payload

    payload = Payload(source="pass\n", filename="<cell 7>", first_line=1, names=b"", bound=(), device="cpu",
                      backend="gloo", pg_timeout=60.0, results=True, results_to_cpu=True)
    return Job(job_id="j1", cwd="/", payload=payload, world=World(2, "cpu", "gloo"), policy=Policy())


def _supervised(frames, sink):
    host = _Recorded(frames)
    states, rows = [], []
    labels = {"<cell 7>": "Cell In[7]", "<cell 5>": "Cell In[5]"}
    remote = RemoteSupervisor(host, _job(), sink, name_for=labels.get,
                              on_state=states.append, on_metrics=lambda key, r: rows.append((key, r)))
    return host, remote, states, rows


def test_the_kernels_side_replays_a_recorded_stream():
    outcome = Outcome(result=b"r", exit_codes={"rank0": 0, "rank1": 0})
    frames = [(Show("write", ["stdout", "[rank0] hi\n"]), b""),
              (Metrics(0, [[1, {"loss": 0.5}]]), b""), (Ask("[rank1] name? "), b""),
              (Show("progress", ["rank0", "stderr", "10%", False]), b""),
              (JobDone(states=["prefetching", "running", "succeeded"]), pickle.dumps((outcome, [], None)))]
    sink = _Asking("ada")
    host, remote, states, rows = _supervised(frames, sink)
    assert remote.run() == outcome
    host.thread.join(5)
    run = host.received[0]
    # the cells' names for tracebacks: this one's and those of the sources sent with it
    assert isinstance(run, RunJob) and run.fds == 0
    assert run.labels == {"<cell 7>": "Cell In[7]", "<cell 5>": "Cell In[5]"}
    assert states == [State.PREFETCHING, State.RUNNING, State.SUCCEEDED]
    assert sink.text() == "[rank0] hi\n" and sink.bars == [("rank0", "10%", False)]
    assert rows == [("rank0", [(1, {"loss": 0.5})])]
    assert sink.asked == [("[rank1] name? ", False)] and host.received[1] == Answer(text="ada")


def test_an_input_box_that_cannot_be_read_is_answered_with_why():
    frames = [(Ask("x? "), b""), (Ask("y? "), b""), (JobDone(), pickle.dumps((Outcome(), [], None)))]
    sink = _Asking(EOFError())
    host, remote, _, _ = _supervised(frames, sink)
    remote.run()
    host.thread.join(5)
    assert host.received[1:] == [Answer(eof=True), Answer(eof=True)]
    host, remote, _, _ = _supervised(frames, Recorder())  # a sink with no input box
    remote.run()
    host.thread.join(5)
    assert all(a.error and "no input box" in a.error for a in host.received[1:])
    host, remote, _, _ = _supervised(frames[1:], _Asking(KeyboardInterrupt()))  # Ctrl-C at the box
    remote.run()
    host.thread.join(5)
    assert host.received[1:] == [Interrupt()]  # the host's wait ends with the job's interrupt


def test_the_hosts_failure_comes_back_as_the_notebook_shows_it():
    rendered = ["rank1 failed: ValueError: boom", "Traceback ...", "ValueError: boom"]
    frames = [(JobDone(failed=True), pickle.dumps((Outcome(exit_codes={"rank1": 1}), [], None))),
              (CellFailed(rendered[0], rendered, "JobFailed"), pickle.dumps({"key": "rank1"}))]
    host, remote, _, _ = _supervised(frames, Recorder())
    with pytest.raises(JobFailed) as raised:
        remote.run()
    assert raised.value._render_traceback_() == rendered and raised.value.report == {"key": "rank1"}
    assert remote.outcome.exit_codes == {"rank1": 1}  # how far it got, for %taas


# -- real processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hosted():
    session = Session()
    session.job_host = KernelHost()
    session.warm()
    yield session
    session.close()


def _ranks_of(host_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(host_pid).children(recursive=True) if p.name().startswith("taas-rank")]


def test_a_job_runs_under_the_host_and_its_values_come_back(hosted):
    sink = _Asking("42")
    cell = ("import os, torch.distributed as dist\n"
            "answer = input('n? ') if dist.get_rank() == 0 else None\n"
            "where = os.getppid()\nprint('rank', dist.get_rank(), x)\n")
    result = hosted.run_cell(cell, {"x": 5}, directive.parse_options("--gpus 2"), sink=sink)
    assert result.values["answer"] == "42" and sink.asked == [("[rank0] n? ", False)]
    assert "[rank0] rank 0 5" in sink.text() and "[rank1] rank 1 5" in sink.text()
    host = psutil.Process(hosted.job_host.proc.pid)
    starter = psutil.Process(result.values["where"])  # rank 0's parent: the start process
    assert host in starter.parents() and os.getpid() != starter.ppid()
    assert hosted.launcher._proc is None  # the kernel's own launcher started nothing


def test_a_failure_in_the_host_is_the_ranks_traceback_with_the_cells_lines(hosted):
    cell = "import torch.distributed as dist\n\nif dist.get_rank() == 1:\n    raise ValueError('boom')\n"
    with pytest.raises(JobFailed) as raised:
        hosted.run_cell(cell, {}, directive.parse_options("--gpus 2"), sink=Recorder(), filename="<cell 3>",
                        name_for=lambda name: "Cell In[3]" if name == "<cell 3>" else None)
    text = "\n".join(raised.value.rendered)
    assert "rank1 failed: ValueError: boom" in raised.value.summary
    assert "Cell In[3], line 4" in text and "raise ValueError('boom')" in text and "taas/" not in text


def test_an_interrupt_stops_the_job_in_the_host(hosted):
    # A kernel's interrupt is Python's KeyboardInterrupt, whatever an earlier test (a Ray
    # driver's, say) left as this process's SIGINT handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_sleeping_job(hosted)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_sleeping_job(hosted):
    class Started(Recorder):
        def __init__(self):
            super().__init__()
            self.ready = threading.Event()

        def write(self, stream, text):
            super().write(stream, text)
            if "sleeping 0" in self.text() and "sleeping 1" in self.text():
                self.ready.set()

    sink = Started()
    main = threading.main_thread().ident

    def interrupt():
        if sink.ready.wait(120):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        hosted.run_cell("import os, time\nprint('sleeping', os.environ['RANK'], flush=True)\ntime.sleep(600)\n", {},
                        directive.parse_options("--gpus 2"), sink=sink)
    assert sink.ready.is_set()
    assert _ranks_of(hosted.job_host.proc.pid) == []
    assert hosted.run_cell("y = 2\n", {}, directive.parse_options("--gpus 2"), sink=Recorder()).values["y"] == 2


def test_a_killed_kernel_takes_its_host_and_ranks_with_it(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import sys
        from taas import directive
        from taas.host.remote import KernelHost
        from taas.session import Session
        session = Session()
        session.job_host = KernelHost()
        session.warm()
        print(session.job_host.proc.pid, flush=True)
        session.run_cell("import time\\nprint('up', flush=True)\\ntime.sleep(600)\\n", {},
                         directive.parse_options("--gpus 2"))
    """))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        host = psutil.Process(int(kernel.stdout.readline()))
        for line in kernel.stdout:  # the ranks run ("[rank0-1] up" once both said so)
            if line.endswith("] up\n"):
                break
        wait_for(lambda: len(_ranks_of(host.pid)) == 2, timeout=60, what="both ranks under the host")
        ranks = _ranks_of(host.pid)
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait()
        gone, alive = psutil.wait_procs([host, *ranks], timeout=5)
        assert alive == []
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()


def test_a_killed_job_host_is_one_line_its_ranks_end_and_the_next_cell_gets_a_new_host(hosted):
    from taas.host.remote import HostGone

    class Killer(Recorder):
        def write(self, stream, text):
            super().write(stream, text)
            if "up 0" in self.text() and "up 1" in self.text() and not getattr(self, "ranks", None):
                host = psutil.Process(hosted.job_host.proc.pid)
                self.ranks = _ranks_of(host.pid)
                os.kill(host.pid, signal.SIGKILL)

    sink = Killer()
    with pytest.raises(HostGone) as raised:
        hosted.run_cell("import os, time\nprint('up', os.environ['RANK'], flush=True)\ntime.sleep(600)\n", {},
                        directive.parse_options("--gpus 2"), sink=sink)
    assert len(str(raised.value).splitlines()) == 1 and "job host ended under the job" in str(raised.value)
    assert len(sink.ranks) == 2
    assert psutil.wait_procs(sink.ranks, timeout=5)[1] == []  # the guard ended them with the host
    again = hosted.run_cell("y = 3\n", {}, directive.parse_options("--gpus 2"), sink=Recorder())
    assert again.values["y"] == 3


def test_kept_ranks_live_in_the_host_keep_their_state_and_end_when_released(hosted):
    keep = directive.parse_options("--gpus 2 --keep")
    cell = "import os, torch.distributed as dist\nstate = dist.get_rank() * 10\nwhere = os.getppid()\n"
    first = hosted.run_cell(cell, {}, keep, sink=Recorder())
    kept = hosted.kept
    assert kept is not None and kept.world.size == 2
    host = psutil.Process(hosted.job_host.proc.pid)
    assert host in psutil.Process(first.values["where"]).parents()  # the host's start process
    ranks = _ranks_of(host.pid)
    assert len(ranks) == 2
    sink = Recorder()
    again = hosted.run_cell("state += 1\nprint('state', state)\n", {}, keep, sink=sink)
    assert again.values["state"] == 1 and "[rank1] state 11" in sink.text()
    assert hosted.kept is kept and kept.cells == 2 and "2 cell(s)" in kept.describe()
    assert kept.handle.lost() is None
    assert hosted.release() == "taas: released the kept ranks (2 on cpu/gloo)"
    assert psutil.wait_procs(ranks, timeout=5)[1] == []
    assert hosted.kept is None


def test_kept_ranks_whose_host_was_killed_are_one_line_and_the_next_cell_starts_fresh(hosted):
    keep = directive.parse_options("--gpus 2 --keep")
    hosted.run_cell("x = 1\n", {}, keep, sink=Recorder())
    host = psutil.Process(hosted.job_host.proc.pid)
    ranks = _ranks_of(host.pid)
    host.kill()
    assert psutil.wait_procs([host, *ranks], timeout=5)[1] == []
    sink = Recorder()
    assert hosted.run_cell("print('fresh')\n", {}, keep, sink=sink).values == {}
    assert ("taas: released the kept ranks (2 on cpu/gloo): their host ended (killed?), and they with it, "
            "so their state is lost; this cell starts fresh ranks\n") in sink.text("stderr")
    assert "[rank0-1] fresh" in sink.text()
    hosted.release()


def test_shared_files_cross_a_door_with_no_descriptors_as_their_bytes():
    """Across machines (a cluster's door) a job's shared files go as their bytes and are memory
    files again on the host's side, in order and with the same contents."""
    import os

    from taas.host.wire import file_bytes, memory_files

    fds = []
    for data in (b"first" * 1000, b"", b"third"):
        fd = os.memfd_create("t")
        os.write(fd, data)
        fds.append(fd)
    try:
        again = memory_files(file_bytes(fds))
        try:
            assert [os.pread(fd, 10_000, 0) for fd in again] == [b"first" * 1000, b"", b"third"]
            assert os.lseek(fds[0], 0, os.SEEK_CUR) == 5000  # the kernel's own files untouched
        finally:
            for fd in again:
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def test_an_interrupt_right_after_a_job_was_sent_interrupts_it_and_the_host_stays(hosted, monkeypatch):
    """Ctrl-C at once after running a cell: the Interrupt reaches the host while the job waits
    to be taken (or runs).  The cell is interrupted or ran; the host never ends over it."""
    from taas.host import remote

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    send, send_fds, late = channel.send, socket.send_fds, []

    def run_job_then_interrupt(sock, message, body=b""):
        send(sock, message, body)
        if isinstance(message, RunJob):
            (late.append if message.fds else lambda _: send(sock, Interrupt()))(sock)

    def fds_then_interrupt(sock, buffers, fds):
        sent = send_fds(sock, buffers, fds)
        while late:
            send(late.pop(), Interrupt())
        return sent

    monkeypatch.setattr(remote.channel, "send", run_job_then_interrupt)
    monkeypatch.setattr(remote.socket, "send_fds", fds_then_interrupt)
    try:
        hosted.warm()
        host = hosted.job_host.proc.pid
        ends = []
        for _ in range(5):
            try:
                hosted.run_cell("y = 1\n", {}, directive.parse_options("--gpus 1"), sink=Recorder())
                ends.append("ran")
            except KeyboardInterrupt:
                ends.append("interrupted")
        assert hosted.job_host.proc.pid == host and hosted.job_host.lost() is None, ends
    finally:
        signal.signal(signal.SIGINT, previous)
        monkeypatch.undo()
    assert hosted.run_cell("y = 2\n", {}, directive.parse_options("--gpus 1"), sink=Recorder()).values["y"] == 2


class _Interrupted(_Recorded):
    """A 'host' that takes the job, waits for its Interrupt, then says it ended."""

    def _play(self):
        self.received.append(channel.recv(self.theirs)[0])
        self.received.append(channel.recv(self.theirs)[0])
        channel.send(self.theirs, JobDone(states=["interrupted"]), pickle.dumps((Outcome(), [], None)))


def test_a_ctrl_c_as_the_job_goes_to_the_host_sends_it_whole_then_interrupts_it_there(monkeypatch):
    from taas.host import remote as module

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    send = channel.send

    def interrupted(sock, message, body=b""):
        send(sock, message, body)
        if isinstance(message, RunJob):
            signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the job goes out

    monkeypatch.setattr(module.channel, "send", interrupted)
    host = _Interrupted([])
    escaped = False
    try:
        RemoteSupervisor(host, _job(), Recorder()).run()  # the host's answer ends it
    except KeyboardInterrupt:  # before the job was watched: left running on the host
        escaped = True
    finally:
        signal.signal(signal.SIGINT, previous)
    host.thread.join(5)
    assert not escaped and [type(m) for m in host.received] == [RunJob, Interrupt]


def test_a_ctrl_c_during_a_new_hosts_first_job_leaves_a_host_that_runs_the_next():
    """An interrupt early in a new host's first job (what the host imports for its jobs, it
    imports before it takes one, shielded) leaves a host whose next job runs."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel
    main = threading.main_thread().ident
    session = Session()
    session.job_host = KernelHost()
    try:
        session.warm()
        timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
        try:
            timer.start()
            session.run_cell("import time\ntime.sleep(30)\n", {}, directive.parse_options("--gpus 2"),
                             sink=Recorder())
        except KeyboardInterrupt:
            pass
        timer.join()
        run = session.run_cell("y = 2\n", {}, directive.parse_options("--gpus 2"), sink=Recorder())
        assert run.values["y"] == 2
    finally:
        signal.signal(signal.SIGINT, previous)
        session.close()


def test_a_kernel_with_over_a_thousand_files_open_gets_a_host_that_runs_its_jobs():
    """The kernel's socket to its host numbered past 1023 (many files open, the limit raised):
    the host waits on it with poll(2); select(2) refused it, the host's reader died, and the
    cell waited for ever while the host outlived the kernel."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the open-file limit ({hard}) leaves no room past fd 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the next fds are past 1023
    session = Session()
    session.job_host = KernelHost()
    try:
        session.warm()
        assert session.job_host.sock.fileno() > 1023
        done: list = []
        cell = threading.Thread(target=lambda: done.append(session.run_cell(
            "y = 3\n", {}, directive.parse_options("--gpus 1"), sink=Recorder())), daemon=True)
        cell.start()
        cell.join(120)
        assert done and done[0].values["y"] == 3
    finally:
        session.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
