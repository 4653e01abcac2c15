"""``python -m taas.host.serve FD KERNEL``: a kernel's own job host, where its attached jobs run.

A detached job runs under a host of its own that outlives the kernel (:mod:`taas.host.main`).
An attached job runs the same way, under this host, a child of the kernel that ends with it:
the kernel prepares the job (the cell read, the values shipped, the GPUs leased) and sends it
here as a :class:`~taas.host.api.RunJob`; the host runs it through the supervisor on its own
launcher (so the start process and the ranks are the host's, not the kernel's) and sends every
Sink call back as it happens, then the outcome.  The kernel is one client of the job: it
starts it, views it, interrupts it, takes its results (:mod:`taas.host.remote`).

    kernel                                   this host (its reader thread, then the main thread)
    RunJob + Job (cloudpickle) + fds  ──>    Supervisor(launcher, job, WireSink).run()
                            <── Show*, Metrics*, Ask (an input box; Answer back)
    Interrupt (Ctrl-C)                ──>    SIGINT to the main thread: the supervisor's interrupt path
                            <── JobDone(states, outcome, the loaders' figures, kept) [+ CellFailed]

The host ends when the kernel does: its end of the socket closes, or the kernel's pid ends
(a pidfd; a fork of the kernel may hold the socket).  It exits at once; its launcher's guard
ends the start process and every rank, as it does for a kernel that dies (the guard watches
this host's pid).
"""

from __future__ import annotations

import linecache
import logging
import os
import pickle
import queue
import select
import signal
import socket
import sys
import threading

import cloudpickle

from taas.host import channel
from taas.host.api import Answer, Ask, CellFailed, Interrupt, JobDone, KeptAnswer, KeptCall, RunJob
from taas.host.cells import failure_of
from taas.host.kept import WireSink
from taas.shield import deferred_interrupt

log = logging.getLogger(__name__)


class AskingSink(WireSink):
    """The kernel's sink, over the socket: every Sink call sent, and ``ask`` answered from it."""

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


class Serving:
    """One kernel's jobs, one at a time, on ``launcher``."""

    def __init__(self, sock: socket.socket, kernel_pid: int, launcher):
        self.sock, self.launcher = sock, launcher
        self.jobs: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self.busy = False  # a job was sent and has not been answered: an Interrupt is for it
        self.labels: dict[str, str] = {}  # the cells' file names -> how tracebacks name them
        self.states: list[str] = []  # the running job's states so far (told with JobDone)
        self.kept = None  # the kept ranks this kernel has here (taas.supervisor.kept.Kept), if any
        try:
            self.kernel = os.pidfd_open(kernel_pid)
        except (OSError, AttributeError):  # no pidfd: the socket alone says the kernel went
            self.kernel = None
        threading.Thread(target=self._read, name="taas-host-reader", daemon=True).start()

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        watched = [self.sock] + ([self.kernel] if self.kernel is not None else [])
        while True:
            try:
                ready, _, _ = select.select(watched, [], [])
                if self.kernel in ready:
                    raise EOFError("the kernel ended")
                message, body = channel.recv(self.sock)
                fds: list[int] = []
                if isinstance(message, RunJob) and message.fds:
                    _, fds, _, _ = socket.recv_fds(self.sock, 1, message.fds)
            except (OSError, EOFError, channel.ProtocolError) as exc:
                log.debug("the kernel is gone (%r): so are its jobs", exc)
                os._exit(0)  # the launcher's guard ends the start process and the ranks
            if isinstance(message, RunJob):
                self.busy = True
                self.jobs.put((message, body, fds))
            elif isinstance(message, KeptCall):
                self.jobs.put((message, b"", []))
            elif isinstance(message, Interrupt):
                if self.busy:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            elif isinstance(message, Answer):
                self.answers.put(message)

    # -- the main thread -----------------------------------------------------------------------
    def serve(self) -> None:
        from taas.supervisor.supervisor import Outcome

        signal.signal(signal.SIGINT, self._on_int)
        while True:
            item = self.jobs.get()
            if isinstance(item[0], KeptCall):
                self._call(item[0])
                continue
            answered: list = []
            try:
                # Python's own handler while the job runs, so that the steps the supervisor and
                # the launcher shield (taas.shield.deferred_interrupt) are never cut.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                try:
                    self._run(*item, answered=answered)
                except KeyboardInterrupt:  # an Interrupt that came just before the job ran
                    if not answered:
                        self._answer(Outcome(), KeyboardInterrupt(), answered)
            except KeyboardInterrupt:  # one that came as the answer went: the job had ended
                pass
            finally:
                signal.signal(signal.SIGINT, self._on_int)

    def _run(self, message: RunJob, body: bytes, fds: list[int], answered: list) -> None:
        from taas.supervisor.cell import KeptCell
        from taas.supervisor.supervisor import Outcome, Supervisor

        job = None
        supervisor: Supervisor | KeptCell | None = None
        try:
            job, sources = pickle.loads(body)
            linecache.cache.update(sources)  # the cells' lines, quoted by tracebacks and stacks
            self.labels.update(message.labels)
            job.shared_fds = tuple(fds)  # the same files, in the same order, as this host's fds
            self.states = []
            while not self.answers.empty():  # answers to a job before this one
                self.answers.get_nowait()
            sink = AskingSink(self.sock, message.in_place, self.answers)
            hooks = dict(name_for=self.labels.get, on_state=lambda state: self.states.append(state.value),
                         on_metrics=lambda key, rows: sink.send(_metrics(key, rows)))
            if message.keep is None:
                supervisor = Supervisor(self.launcher, job, sink, **hooks)
                supervisor.run()
            else:  # on the kept ranks this kernel has here (or new ones), which stay after it
                kept = self.kept if self.kept is not None and self.kept.job_id == message.kept else None
                supervisor = KeptCell(self.launcher, job, sink, kept=kept, limit=message.keep, **hooks)
                try:
                    supervisor.run()
                finally:
                    self.kept = supervisor.kept
            self._answer(supervisor.outcome, None, answered, job)
        except BaseException as exc:  # what the notebook shows, whatever it was
            self._answer(supervisor.outcome if supervisor else Outcome(), exc, answered, job)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _answer(self, outcome, exc: BaseException | None, answered: list, job=None) -> None:
        if answered:
            return
        answered.append(True)
        with deferred_interrupt():  # the answer's frames go whole (a late Interrupt is dropped)
            self._send_answer(outcome, exc, job)

    def _send_answer(self, outcome, exc: BaseException | None, job) -> None:
        self.busy = False  # before the answer: the kernel's next RunJob may follow at once
        figures = job.data.figures() if job is not None and job.data is not None else []
        kept = None if self.kept is None else dict(
            job_id=self.kept.job_id, world=(self.kept.world.size, self.kept.world.device, self.kept.world.backend),
            cells=self.kept.cells,
            gpu_mem=dict(self.kept.gpu_mem))
        body = pickle.dumps((outcome, figures, kept), protocol=pickle.HIGHEST_PROTOCOL)
        with _quiet():
            channel.send(self.sock, JobDone(failed=exc is not None, states=self.states), body)
            if exc is not None:
                failure = failure_of(exc)
                report = getattr(exc, "report", None)
                channel.send(self.sock, CellFailed(failure.summary, list(failure.rendered), failure.kind),
                             _pickled(report))

    def _call(self, message: KeptCall) -> None:
        """A question about the kept ranks, or their release, between cells."""
        kept = self.kept
        value: object = None
        try:
            if message.call == "release":
                self.kept = None
                if kept is not None:  # the layers' merge notes go to the kernel's sink
                    kept.release(AskingSink(self.sock, True, self.answers))
            elif kept is not None and message.call == "memory":
                value = kept.handle.memory()
            elif kept is not None and message.call == "reserved":
                value = kept.handle.reserved()
        except Exception as exc:  # the kernel asked between cells: it gets what went wrong
            log.debug("kept ranks, %s: %r", message.call, exc)
        with _quiet():
            channel.send(self.sock, KeptAnswer(value))

    def _on_int(self, signum, frame) -> None:
        if self.busy:  # the kernel's Interrupt: only a job hears it
            raise KeyboardInterrupt


def _metrics(key: str, rows):
    from taas.host.api import Metrics
    from taas.io import keys

    return Metrics(keys.rank_of(key), [[step, values] for step, values in rows])


def _pickled(value) -> bytes:
    try:
        return cloudpickle.dumps(value)
    except Exception:  # a report that cannot travel: the rendering says it all
        return cloudpickle.dumps(None)


class _quiet:
    """A kernel gone meanwhile costs nothing here: the reader thread ends this host."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, OSError)


def main(argv: list[str]) -> None:
    from taas.wiring import launcher_from_env

    sock = socket.socket(fileno=int(argv[0]))
    launcher = launcher_from_env()
    launcher.warm()  # the start process imports torch while the kernel waits for its first cell
    Serving(sock, int(argv[1]), launcher).serve()


if __name__ == "__main__":
    logging.basicConfig(level=logging.DEBUG if os.environ.get("TAAS_HOST_DEBUG") else logging.WARNING,
                        format="%(asctime)s taas-host %(name)s: %(message)s")
    main(sys.argv[1:])
