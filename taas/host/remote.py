"""The kernel's side of its own job host (:mod:`taas.host.serve`): attached jobs run there.

:class:`KernelHost` is the child process, started at ``%load_ext`` (warm: its start process
imports torch meanwhile) and again if it died.  :meth:`KernelHost.supervisor` is what the
Session builds for each job on this machine instead of a :class:`~taas.supervisor.supervisor.
Supervisor`: a :class:`RemoteSupervisor`, with the same calls (``run()``, ``outcome``), that
sends the job to the host and replays what the host's supervisor does on the notebook's sink,
as it happens.

    run():  RunJob + the Job (cloudpickle, code keeping its file names; the cells' sources;
            its shared fds as SCM_RIGHTS) ──> host
            Show ──> sink.write/progress/display/live/panel
            Metrics ──> on_metrics                                Ask ──> sink.ask ──> Answer
            Ctrl-C ──> Interrupt (each one; the host's supervisor decides what it means)
            JobDone(states ──> on_state, outcome, loaders' figures, kept ranks) [+ CellFailed]
                ──> the outcome, or the cell's exception rebuilt as the notebook shows it

Kept ranks (``--keep``) live in the host too: :class:`RemoteKeptCell` runs a cell on them,
:class:`RemoteKept` is the kernel's bookkeeping of them (what they hold, their idle limit, the
results channel) and asks the host the rest between cells (:meth:`HostLink.call`).  Kept ranks
a kernel adopted from a detached job (taas.host.adopt) are the same to it: their host is
reached through its door (an :class:`adopt.Door`, a :class:`HostLink` too) instead.

A frame is read whole with SIGINT only noted, so an interrupt never cuts the stream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

from taas.errors import LaunchError
from taas.host import channel
from taas.host.api import (SHOWN, Answer, Ask, Ended, Interrupt, JobDone, KeptAnswer, KeptCall, Metrics,
                           RunJob, Show)
from taas.host.cells import cell_sources, rebuilt
from taas.host.wire import file_bytes
from taas.job import crossing
from taas.job.api import World
from taas.shield import deferred_interrupt
from taas.supervisor.kept import Kept
from taas.ready import readable

log = logging.getLogger(__name__)


class HostGone(LaunchError):
    """The host ended under a job (killed?), or its kept ranks did: the job ended with it."""


class HostLink:
    """A socket to a host that runs this kernel's jobs (its own, :class:`KernelHost`; or the
    host of kept ranks it adopted, taas.host.adopt.Door), and what the host has been sent."""

    inline_fds = False  # a job's shared files go as their bytes (no SCM_RIGHTS to the host)
    record = ""  # the detached job whose kept ranks the host keeps ("": the kernel's own host)

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.ended: str | None = None  # the host's last word: the kept ranks ended
        self._sent: set[str] = set()  # the cells' sources this host has (fresh_sources)

    def warm(self) -> None:
        """Have the host ready for a job."""

    def lost(self) -> str | None:
        """Why the host (and the kept ranks it keeps) is gone, or None."""
        raise NotImplementedError

    def gone_line(self) -> str:
        """What a job that the host's end cut short says."""
        raise NotImplementedError

    def fresh_sources(self) -> dict:
        """The notebook's cells (linecache's entries with no file behind them) the host has not
        been sent yet: what its tracebacks and stacks quote the cells' lines from."""
        fresh = {name: entry for name, entry in cell_sources().items() if name not in self._sent}
        self._sent.update(fresh)
        return fresh

    def supervisor(self, launcher, job, sink, *, name_for=None, on_state=None, on_metrics=None):
        """A :class:`RemoteSupervisor` for ``job`` (``launcher``: the kernel's, which the host
        has its own of)."""
        self.warm()
        return RemoteSupervisor(self, job, sink, name_for=name_for, on_state=on_state, on_metrics=on_metrics)

    def kept_cell(self, launcher, job, sink, *, kept, limit: float, name_for=None, on_state=None,
                  on_metrics=None):
        """A :class:`RemoteKeptCell` for ``job`` on ``kept`` (a :class:`RemoteKept`; None: it
        starts kept ranks in the host), with a KeptCell's calls."""
        if kept is None:
            self.warm()
        return RemoteKeptCell(self, job, sink, name_for=name_for, on_state=on_state, on_metrics=on_metrics,
                              launcher=launcher, kept=kept, limit=limit)

    def call(self, what: str, sink=None):
        """Ask the host about the kept ranks it keeps for this kernel (``memory``, ``reserved``)
        or ``release`` them; Show frames meanwhile go to ``sink``.  A host that is gone: None."""
        gone = None
        sock = self.sock
        if sock is None:
            return gone
        noted: list = []  # a Ctrl-C meanwhile is dropped: the answer comes, and frames are read whole
        try:
            channel.send(sock, KeptCall(what))
            while True:
                with channel.noting(noted):
                    message, _ = channel.recv(sock)
                if isinstance(message, KeptAnswer):
                    return message.value
                if isinstance(message, Show) and message.call in SHOWN and sink is not None:
                    getattr(sink, message.call)(*message.args)
                if isinstance(message, Ended):
                    self.ended = message.line
                    return gone
        except (OSError, EOFError, channel.ProtocolError):
            self.close()
            return gone

    def close(self) -> None:
        raise NotImplementedError


class KernelHost(HostLink):
    """This kernel's job host: a child in a session of its own (the kernel's interrupt is the
    kernel's), ended by the kernel's end."""

    def __init__(self) -> None:
        super().__init__()
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Start the host if it is not running (its start process then imports torch)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            self._close()
            self._sent.clear()  # a new host has been sent nothing
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            # In "/": each job says where its ranks start, and the notebook's directory may go.
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            with theirs:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "taas.host.serve", str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
                    cwd="/", env=env)
            self.sock = ours

    def lost(self) -> str | None:
        proc = self.proc
        if self.sock is None or proc is None or proc.poll() is not None:
            return "their host ended (killed?), and they with it"
        return None

    def gone_line(self) -> str:
        return ("taas: this kernel's job host ended under the job (killed?), and the job with it; "
                "run the cell again to start a new one")

    def close(self) -> None:
        """The host ends (and any job it runs, with it)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class RemoteSupervisor:
    """One job run by the kernel's host, seen from the kernel (a Supervisor's calls)."""

    def __init__(self, host: HostLink, job, sink, *, name_for=None, on_state=None, on_metrics=None):
        from taas.supervisor.supervisor import Outcome

        self.host, self.job, self.sink = host, job, sink
        self.name_for = name_for or (lambda name: None)
        self.on_state = on_state or (lambda state: None)
        self.on_metrics = on_metrics or (lambda key, rows: None)
        self.outcome = Outcome()

    def run(self):
        """The job to its end on the host: the outcome, or what the supervisor raised there."""
        sock = self.host.sock
        assert sock is not None
        job = self.job
        filename = job.payload.filename
        sources = self.host.fresh_sources()  # the cells' lines, for the host's tracebacks and stacks
        labels = {name: label for name in (*sources, filename) if (label := self.name_for(name))}
        # As it is, but code keeps its file names (the cells' own, for tracebacks; cloudpickle's
        # own would be "<dynamic-code>").
        # A door to another machine takes no descriptors: the shared files' bytes go in the body.
        inline = file_bytes(job.shared_fds) if self.host.inline_fds else []
        body = crossing.dumps((dataclasses.replace(job, shared_fds=()), sources, inline), crossing.AS_IS)
        message = dataclasses.replace(self._message(), labels=labels)
        if self.host.inline_fds:
            message = dataclasses.replace(message, fds=0)
        try:
            with deferred_interrupt():  # the job goes whole: a frame cut halfway derails the stream
                channel.send(sock, message, body)
                if job.shared_fds and not self.host.inline_fds:
                    socket.send_fds(sock, [b"F"], list(job.shared_fds))
        except OSError:
            self._gone()
        except KeyboardInterrupt:  # held while it went: the host has the job, so it is interrupted there
            self._interrupt()
        while True:
            try:
                readable([sock])  # nothing read yet: an interrupt may land here
            except KeyboardInterrupt:
                self._interrupt()
                continue
            noted: list = []
            with channel.noting(noted):  # a frame read and handled whole, or the stream loses its place
                message, body = self._next(sock)
                done = None if isinstance(message, Ask) else self._handle(message, body)
            if noted:
                self._interrupt()
            if isinstance(message, Ask):  # the input box waits for the user: Ctrl-C must reach it
                self._ask(message)
            if isinstance(message, Ended):  # the kept ranks ended under the cell (a cancel)
                self.host.ended = message.line
                self._kept(None)
                raise HostGone(message.line)
            if done is not None:
                failed, figures, kept = done
                if job.data is not None:
                    job.data.take_figures(figures)
                self._kept(kept)
                if failed:
                    with channel.noting(noted):  # read whole (the job has ended: a Ctrl-C now is moot)
                        failure, report = self._next(sock)
                    raise rebuilt(failure, report)
                return self.outcome

    def _message(self) -> RunJob:
        """What asks the host to run this job."""
        job = self.job
        return RunJob(len(job.shared_fds), {}, getattr(self.sink, "updates_in_place", True))

    def _kept(self, kept: dict | None) -> None:
        """The kept ranks the host has after the job (a one-cell job: nothing to do)."""

    def _handle(self, message, body: bytes):
        """One frame from the host; ``(failed, figures, kept)`` when it says the job ended."""
        from taas.io import keys
        from taas.supervisor.machine import State

        if isinstance(message, Show):
            if message.call in SHOWN:
                self._show(message)
        elif isinstance(message, Metrics):
            self.on_metrics(keys.rank_key(message.rank), [(step, values) for step, values in message.rows])
        elif isinstance(message, JobDone):
            for state in message.states:
                self.on_state(State(state))
            self.outcome, figures, kept = pickle.loads(body)
            return message.failed, figures, kept
        return None

    def _show(self, message: Show) -> None:
        try:
            getattr(self.sink, message.call)(*message.args)
        except Exception as exc:  # a call this sink cannot show costs itself, never the stream
            log.debug("%s(...) not shown: %r", message.call, exc)

    def _ask(self, message: Ask) -> None:
        from taas.supervisor.prompts import read_line

        try:
            answer = Answer(**read_line(self.sink, message.prompt, message.password))
        except KeyboardInterrupt:  # at the input box: the job's interrupt (the host's wait for the
            self._interrupt()      # answer ends with it, as ``ask`` raising does here)
            return
        self._send(answer)

    def _send(self, message) -> None:
        try:
            channel.send(self.host.sock, message)
        except OSError:
            self._gone()

    def _interrupt(self) -> None:
        self._send(Interrupt())

    def _next(self, sock):
        try:
            message, body = channel.recv(sock)
        except (OSError, EOFError, channel.ProtocolError) as exc:
            log.debug("the job host: %r", exc)
            self._gone()
        return message, body

    def _gone(self):
        line = self.host.gone_line()
        self.host.close()
        raise HostGone(line)


class RemoteHandle:
    """The kept ranks' handle as the kernel's bookkeeping asks it (the host has the real one)."""

    def __init__(self, host: HostLink):
        self.host = host

    def lost(self) -> str | None:
        """Their host is gone (so are they), or told that they ended; else None.  A rank that
        ended is found by the host when the next cell is sent (KeptRanksGone: the cell runs on
        fresh ranks), so a cell costs no round trip to ask."""
        return self.host.lost()

    def memory(self) -> dict:
        return self.host.call("memory") or {}

    def reserved(self) -> str:
        return self.host.call("reserved") or ""


class RemoteKept(Kept):
    """The kernel's bookkeeping of kept ranks that live in a host: what they hold, their idle
    limit, the results channel (all here), and a :class:`RemoteHandle`.  The host is this
    kernel's own (:class:`KernelHost`), or a detached job's whose kept ranks it adopted
    (taas.host.adopt.Door; ``whose`` then names the job)."""

    def __init__(self, host: HostLink, launcher, info: dict, limit: float):
        super().__init__(launcher, RemoteHandle(host), World(*info["world"]), info["job_id"], None, limit)
        self.host = host
        self.whose = f" of job {host.record}" if host.record else ""
        self.adopted = bool(host.record)

    def let_go(self) -> None:
        """No longer this kernel's (adopted ranks): they wait for the next kernel."""
        self.handle = None
        self.host.close()

    def update(self, info: dict) -> None:
        self.cells = info["cells"]
        self.gpu_mem.update(info["gpu_mem"])
        self.last_used = time.monotonic()

    def release(self, sink=None) -> None:
        if self.handle is None:
            return
        self.handle = None
        try:
            self.host.call("release", sink)  # stopped, their layers merged, in the host
            if self.host.record:  # a detached job's host: it ends with them
                self.host.close()
        finally:
            with deferred_interrupt():  # a Ctrl-C here would leak the channel's descriptors
                channel, self.channel = self.channel, None
                if channel is not None:
                    channel.close()


class RemoteKeptCell(RemoteSupervisor):
    """One cell on kept ranks in the kernel's job host (a KeptCell's calls: ``run()``,
    ``outcome``, ``kept``: the kernel's :class:`RemoteKept` after it, or None)."""

    def __init__(self, host: HostLink, job, sink, *, launcher, kept: RemoteKept | None, limit: float, **hooks):
        super().__init__(host, job, sink, **hooks)
        self.launcher, self.kept, self.limit = launcher, kept, limit

    def _message(self) -> RunJob:
        return dataclasses.replace(super()._message(), keep=self.limit, kept=self.kept.job_id if self.kept else "")

    def _kept(self, info: dict | None) -> None:
        if info is None:  # they ended (lost, or a rank short before the cell was sent)
            if self.kept is not None:  # nothing of them is left to end but the results channel
                self.kept.handle = None
                if self.kept.channel is not None:
                    self.kept.channel.close()
                    self.kept.channel = None
            self.kept = None
        elif self.kept is not None and self.kept.job_id == info["job_id"]:
            self.kept.update(info)
            self.kept.limit = self.limit
        else:
            self.kept = RemoteKept(self.host, self.launcher, info, self.limit)
            self.kept.update(info)
