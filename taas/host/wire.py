"""One job run in a host for a kernel on the other end of a socket: the frames both ends share.

The kernel's own host (:mod:`taas.host.serve`) and a kept job's host serving the kernel that
adopted its ranks (:mod:`taas.host.kept`) run a kernel's prepared job the same way
(:func:`run_job`): the Job from a :class:`~taas.host.api.RunJob` frame, run through the
supervisor on the host's launcher (a :class:`~taas.supervisor.cell.KeptCell` on the kept ranks
for ``--keep``), every Sink call sent back as it happens (:class:`WireSink`; ``ask`` answered
by the kernel: :class:`AskingSink`), then :func:`answer`'s JobDone [+ CellFailed].

A job's shared files cross a Unix socket as SCM_RIGHTS; across machines (a cluster's door:
taas.host.ray.door) their bytes travel in the frame's body instead (:func:`memory_files` makes
them files again here).
"""

from __future__ import annotations

import linecache
import logging
import os
import pickle
import queue
import socket
import threading

import cloudpickle

from taas.host import channel
from taas.host.api import Answer, Ask, CellFailed, JobDone, Metrics, RunJob, Show
from taas.host.cells import failure_of
from taas.shield import deferred_interrupt

log = logging.getLogger(__name__)


class WireSink:
    """The Sink calls of one job, sent to the kernel as they happen.  A kernel that is gone
    meanwhile costs nothing: the job goes on (a kept job's output is in its record's log)."""

    def __init__(self, conn: socket.socket, in_place: bool):
        self.conn = conn
        self.updates_in_place = in_place
        self.gone = False
        self._lock = threading.Lock()  # the supervisor's and the plot's threads both show

    def send(self, message, body: bytes = b"") -> None:
        if self.gone:
            return
        try:
            # Whole, or the kernel's stream loses its place (a Ctrl-C while a big frame goes out)
            with deferred_interrupt(), self._lock:
                channel.send(self.conn, message, body)
        except OSError:
            self.gone = True

    def write(self, stream: str, text: str) -> None:
        self.send(Show("write", [stream, text]))

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        self.send(Show("progress", [key, stream, text, final]))

    def display(self, data: dict, metadata: dict) -> None:
        self.send(Show("display", [data, metadata]))

    def live(self, name: str, data: dict, metadata: dict, final: bool) -> None:
        self.send(Show("live", [name, data, metadata, final]))

    def panel(self, bundle: dict, metadata: dict, final: bool) -> None:
        self.send(Show("panel", [bundle, metadata, final]))

    def metrics(self, job_id: str, rank: int, rows) -> None:
        self.send(Metrics(rank, [[step, values] for step, values in rows]))


class AskingSink(WireSink):
    """The kernel's sink, over the socket: every Sink call sent, and ``ask`` answered from it
    (its Answer frames put in ``answers`` by the host's reader thread)."""

    def __init__(self, conn: socket.socket, in_place: bool, answers: queue.Queue):
        super().__init__(conn, in_place)
        self.answers = answers

    def ask(self, prompt: str, password: bool = False) -> str:
        from taas.errors import NoStdin

        self.send(Ask(prompt, password))
        if self.gone:
            raise NoStdin("the notebook that ran this job is gone")
        answer: Answer = self.answers.get()  # a SIGINT (the kernel's Interrupt) ends the wait
        if answer.eof:
            raise EOFError
        if answer.error is not None:
            raise NoStdin(answer.error)
        return answer.text or ""


class Tee:
    """One Sink that is two: the kernel's (it answers ``ask``) and a kept job's record's."""

    def __init__(self, first: AskingSink, second):
        self.first, self.second = first, second
        self.updates_in_place = first.updates_in_place

    def ask(self, prompt: str, password: bool = False) -> str:
        return self.first.ask(prompt, password)

    def write(self, stream: str, text: str) -> None:
        self.first.write(stream, text)
        self.second.write(stream, text)

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        self.first.progress(key, stream, text, final)
        self.second.progress(key, stream, text, final)

    def display(self, data: dict, metadata: dict) -> None:
        self.first.display(data, metadata)
        self.second.display(data, metadata)

    def live(self, name: str, data: dict, metadata: dict, final: bool) -> None:
        self.first.live(name, data, metadata, final)
        self.second.live(name, data, metadata, final)

    def panel(self, bundle: dict, metadata: dict, final: bool) -> None:
        self.first.panel(bundle, metadata, final)
        self.second.panel(bundle, metadata, final)


class Run:
    """One RunJob's run (:meth:`run`): the supervisor's ``outcome`` so far, the ``states`` the
    job entered, the kept ranks after it (``kept``), the Job once read (``job``)."""

    def __init__(self, launcher, message: RunJob, body: bytes, fds: list[int], sink: WireSink | Tee,
                 labels: dict, kept=None, on_metrics=None, starts: bool = True):
        """``kept``: the kept ranks this host has (a :class:`~taas.supervisor.kept.Kept`), which
        a ``--keep`` job naming them runs on; ``labels``: the cells' file names -> how
        tracebacks name them, updated with the message's; ``on_metrics(key, rows)``: the ranks'
        ``taas.log`` rows (default: sent to the kernel, ``sink`` being a WireSink); ``starts``:
        whether a job may start ranks (False: only cells on ``kept``, a kept job's host)."""
        from taas.supervisor.supervisor import Outcome

        self.launcher, self.message, self.body, self.fds, self.sink = launcher, message, body, fds, sink
        self.labels, self.kept, self.starts = labels, kept, starts
        self.on_metrics = on_metrics or (lambda key, rows: sink.send(metrics_frame(key, rows)))
        self.states: list[str] = []
        self.job = None
        self._supervisor = None
        self._outcome = Outcome()

    @property
    def outcome(self):
        return self._supervisor.outcome if self._supervisor is not None else self._outcome

    def run(self) -> None:
        """The job to its end (what the supervisor raises, raised); the fds closed however."""
        from taas.supervisor.cell import KeptCell
        from taas.supervisor.supervisor import Supervisor

        message = self.message
        try:
            job, sources, *inline = pickle.loads(self.body)
            linecache.cache.update(sources)  # the cells' lines, quoted by tracebacks and stacks
            self.labels.update(message.labels)
            if inline and inline[0]:  # the shared files' bytes (a door across machines)
                self.fds = memory_files(inline[0])
            job.shared_fds = tuple(self.fds)  # the same files, in the same order, as this host's fds
            self.job = job
            sink = self.sink
            hooks = dict(name_for=self.labels.get, on_state=lambda state: self.states.append(state.value),
                         on_metrics=self.on_metrics)
            kept = self.kept if self.kept is not None and self.kept.job_id == message.kept else None
            if kept is None and (message.kept or not self.starts):
                from taas.errors import KeptRanksGone

                raise KeptRanksGone("they ended before this cell reached them")
            if message.keep is None:
                self._supervisor = Supervisor(self.launcher, job, sink, **hooks)
                self._supervisor.run()
                return
            # On the kept ranks this host has (or new ones), which stay after it.
            launcher = kept.launcher if kept is not None else self.launcher
            cell = self._supervisor = KeptCell(launcher, job, sink, kept=kept, limit=message.keep, **hooks)
            try:
                cell.run()
            finally:
                self.kept = cell.kept
        finally:
            self.close_fds()

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def answer(conn: socket.socket, run: Run, exc: BaseException | None) -> None:
    """The job's end, to the kernel: JobDone (its states, the supervisor's outcome, the loaders'
    figures, the kept ranks after it), then CellFailed when it raised.  Sent whole (a late
    interrupt is dropped); a kernel gone meanwhile costs nothing."""
    job = run.job
    figures = job.data.figures() if job is not None and job.data is not None else []
    body = pickle.dumps((run.outcome, figures, kept_info(run.kept)), protocol=pickle.HIGHEST_PROTOCOL)
    with deferred_interrupt(), _quiet():
        channel.send(conn, JobDone(failed=exc is not None, states=run.states), body)
        if exc is not None:
            failure = failure_of(exc)
            report = getattr(exc, "report", None)
            channel.send(conn, CellFailed(failure.summary, list(failure.rendered), failure.kind), _pickled(report))


def kept_call(kept, call: str, sink) -> object:
    """A kernel's question about the kept ranks between cells (``memory``, ``reserved``) or
    their ``release`` (the layers' merge notes shown on ``sink``); the answer (None: none)."""
    if kept is None:
        return None
    if call == "release":
        kept.release(sink)
        return None
    if call == "memory":
        return kept.handle.memory()
    if call == "reserved":
        return kept.handle.reserved()
    return None


def kept_info(kept) -> dict | None:
    """What a kernel keeps of kept ranks (taas.host.remote.RemoteKept): None when there are none."""
    if kept is None:
        return None
    world = kept.world
    return dict(job_id=kept.job_id, world=(world.size, world.device, world.backend), cells=kept.cells,
                gpu_mem=dict(kept.gpu_mem), limit=None if kept.limit == float("inf") else kept.limit)


def prepared_bytes(work) -> bytes:
    """A prepared job (taas.host.api.Prepared) for a host on another machine: pickled as it is
    (code keeps its file names: the cells' own, for tracebacks), with its shared files' bytes
    (:func:`memory_files` makes them files again there)."""
    import dataclasses

    from taas.job import crossing

    job = work.job
    return crossing.dumps((dataclasses.replace(work, job=dataclasses.replace(job, shared_fds=())),
                           file_bytes(job.shared_fds)), crossing.AS_IS)


def file_bytes(fds) -> list[bytes]:
    """The shared files' contents, to cross a door with no SCM_RIGHTS (another machine)."""
    out = []
    for fd in fds:
        with open(os.dup(fd), "rb") as f:
            f.seek(0)
            out.append(f.read())
    return out


def memory_files(contents: list[bytes]) -> list[int]:
    """Read-only memory files holding ``contents``, in order (as the kernel's shared files)."""
    fds = []
    for data in contents:
        fd = os.memfd_create("taas-shared", os.MFD_CLOEXEC)
        with open(os.dup(fd), "wb") as f:
            f.write(data)
        os.lseek(fd, 0, os.SEEK_SET)
        fds.append(fd)
    return fds


def metrics_frame(key: str, rows) -> Metrics:
    """Rank ``key``'s new ``taas.log`` rows as a frame."""
    from taas.io import keys

    return Metrics(keys.rank_of(key), [[step, values] for step, values in rows])


def _pickled(value) -> bytes:
    try:
        return cloudpickle.dumps(value)
    except Exception:  # a report that cannot travel: the rendering says it all
        return cloudpickle.dumps(None)


class _quiet:
    """A kernel gone meanwhile costs nothing here: its reader notices and acts."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, OSError)
