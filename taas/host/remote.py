"""The kernel's side of its own job host (:mod:`taas.host.serve`): attached jobs run there.

:class:`KernelHost` is the child process, started at ``%load_ext`` (warm: its start process
imports torch meanwhile) and again if it died.  :meth:`KernelHost.supervisor` is what the
Session builds for each job on this machine instead of a :class:`~taas.supervisor.supervisor.
Supervisor`: a :class:`RemoteSupervisor`, with the same calls (``run()``, ``outcome``), that
sends the job to the host and replays what the host's supervisor does on the notebook's sink,
as it happens.

    run():  RunJob + the Job (cloudpickle; its shared fds as SCM_RIGHTS) ──> host
            Show ──> sink.write/progress/display/live/panel      JobState ──> on_state
            Metrics ──> on_metrics                                Ask ──> sink.ask ──> Answer
            Ctrl-C ──> Interrupt (each one; the host's supervisor decides what it means)
            JobDone(outcome, loaders' figures) [+ CellFailed] ──> the outcome, or the cell's
            exception rebuilt as the notebook shows it

A frame is read whole with SIGINT only noted, so an interrupt never cuts the stream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading

from taas.errors import LaunchError, NoStdin, RenderedError
from taas.host import channel
from taas.host.adopt import _failure, _noting
from taas.job import crossing
from taas.host.api import (SHOWN, Answer, Ask, CellFailed, Interrupt, JobDone, JobState, Metrics, RunJob,
                           Show)

log = logging.getLogger(__name__)


class HostGone(LaunchError):
    """The kernel's job host ended under a job (killed?): the job ended with it."""


class KernelHost:
    """This kernel's job host: a child in a session of its own (the kernel's interrupt is the
    kernel's), ended by the kernel's end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._sent: set[str] = set()  # the cells' sources this host has (fresh_sources)

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

    def fresh_sources(self) -> dict:
        """The notebook's cells (linecache's entries with no file behind them) the host has not
        been sent yet: what its tracebacks and stacks quote the cells' lines from."""
        import linecache

        fresh = {name: entry for name, entry in list(linecache.cache.items())
                 if len(entry) == 4 and entry[1] is None and name not in self._sent}
        self._sent.update(fresh)
        return fresh

    def supervisor(self, launcher, job, sink, *, name_for=None, on_state=None, on_metrics=None):
        """A :class:`RemoteSupervisor` for ``job`` (``launcher``: the kernel's, which the host
        has its own of)."""
        self.warm()
        return RemoteSupervisor(self, job, sink, name_for=name_for, on_state=on_state, on_metrics=on_metrics)

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

    def __init__(self, host: KernelHost, job, sink, *, name_for=None, on_state=None, on_metrics=None):
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
        body = crossing.dumps((dataclasses.replace(job, shared_fds=()), sources), crossing.AS_IS)
        message = RunJob(len(job.shared_fds), labels, getattr(self.sink, "updates_in_place", True))
        try:
            channel.send(sock, message, body)
            if job.shared_fds:
                socket.send_fds(sock, [b"F"], list(job.shared_fds))
        except OSError:
            self._gone()
        while True:
            try:
                select.select([sock], [], [])  # nothing read yet: an interrupt may land here
            except KeyboardInterrupt:
                self._interrupt(sock)
                continue
            noted: list = []
            with _noting(noted):  # a frame read and handled whole, or the stream loses its place
                message, body = self._next(sock)
                done = None if isinstance(message, Ask) else self._handle(message, body)
            if noted:
                self._interrupt(sock)
            if isinstance(message, Ask):  # the input box waits for the user: Ctrl-C must reach it
                self._ask(message)
            if done is not None:
                failed, figures = done
                if job.data is not None:
                    job.data.take_figures(figures)
                if failed:
                    failure, report = self._next(sock)
                    raise _rebuilt(failure, report)
                return self.outcome

    def _handle(self, message, body: bytes):
        """One frame from the host; ``(failed, figures)`` when it says the job ended."""
        from taas.io import keys
        from taas.supervisor.machine import State

        if isinstance(message, Show):
            if message.call in SHOWN:
                self._show(message)
        elif isinstance(message, JobState):
            self.on_state(State(message.state))
        elif isinstance(message, Metrics):
            self.on_metrics(keys.rank_key(message.rank), [(step, values) for step, values in message.rows])
        elif isinstance(message, JobDone):
            self.outcome, figures = pickle.loads(body)
            return message.failed, figures
        return None

    def _show(self, message: Show) -> None:
        try:
            getattr(self.sink, message.call)(*message.args)
        except Exception as exc:  # a call this sink cannot show costs itself, never the stream
            log.debug("%s(...) not shown: %r", message.call, exc)

    def _ask(self, message: Ask) -> None:
        prompt = getattr(self.sink, "ask", None)
        try:
            if prompt is None:
                raise NoStdin("this job has no input box to read from: input() and pdb in a rank need "
                              "an interactive notebook")
            answer = Answer(text=prompt(message.prompt, message.password))
        except EOFError:
            answer = Answer(eof=True)
        except NoStdin as exc:
            answer = Answer(error=str(exc))
        except OSError as exc:
            answer = Answer(error=f"stdin cannot be read here: {exc}")
        except KeyboardInterrupt:  # at the input box: the job's interrupt (the host's wait for the
            self._interrupt(self.host.sock)  # answer ends with it, as ``ask`` raising does here)
            return
        self._send(answer)

    def _send(self, message) -> None:
        try:
            channel.send(self.host.sock, message)
        except OSError:
            self._gone()

    def _interrupt(self, sock) -> None:
        self._send(Interrupt())

    def _next(self, sock):
        try:
            message, body = channel.recv(sock)
        except (OSError, EOFError, channel.ProtocolError) as exc:
            log.debug("the job host: %r", exc)
            self._gone()
        return message, body

    def _gone(self):
        self.host.close()
        raise HostGone("taas: this kernel's job host ended under the job (killed?), and the job with it; "
                       "run the cell again to start a new one")


def _rebuilt(failure: CellFailed, report_body: bytes) -> BaseException:
    """The exception the host's supervisor raised, as the notebook shows it."""
    from taas import errors

    kind = getattr(errors, failure.error, None)
    if failure.error == "KeyboardInterrupt" or kind is None or not isinstance(kind, type):
        return _failure(failure)
    if issubclass(kind, errors.JobFailed):
        try:
            report = pickle.loads(report_body) if report_body else None
        except Exception:  # a report that cannot be read: the rendering says it all
            report = None
        return kind(failure.summary, list(failure.rendered) or None, report)
    if issubclass(kind, RenderedError):
        return kind(failure.summary, list(failure.rendered) or None)
    try:
        return kind(failure.summary)
    except TypeError:
        return _failure(failure)
