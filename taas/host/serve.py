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
                                             (the job not taken yet: answered as interrupted)
                            <── JobDone(states, outcome, the loaders' figures, kept) [+ CellFailed]

The host ends when the kernel does: its end of the socket closes, or the kernel's pid ends
(a pidfd; a fork of the kernel may hold the socket), watched from the host's first instant
(:func:`end_with`: it imports torch for a few seconds before it serves).  It exits at once; its
launcher's guard ends the start process and every rank, as it does for a kernel that dies (the
guard watches this host's pid).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading

from taas.host import channel
from taas.host.api import Answer, Interrupt, KeptAnswer, KeptCall, RunJob
from taas.host.wire import AskingSink, Run, answer, kept_call
from taas.shield import deferred_interrupt
from taas.ready import readable, wait_readable

log = logging.getLogger(__name__)


class Serving:
    """One kernel's jobs, one at a time, on ``launcher``."""

    def __init__(self, sock: socket.socket, kernel_pid: int, launcher):
        self.sock, self.launcher = sock, launcher
        self.jobs: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self.busy = False  # a job was sent and has not been answered: an Interrupt is for it
        self.early = False  # an Interrupt came for the job sent before it was taken (_on_int)
        self.labels: dict[str, str] = {}  # the cells' file names -> how tracebacks name them
        self.kept = None  # the kept ranks this kernel has here (taas.supervisor.kept.Kept), if any
        try:
            self.kernel = os.pidfd_open(kernel_pid)
        except (OSError, AttributeError):  # no pidfd: the socket alone says the kernel went
            self.kernel = None
        # Ours before the reader runs: the kernel's first cell and its Ctrl-C may be waiting on
        # the socket already (sent while this host started), and Python's handler would end it.
        signal.signal(signal.SIGINT, self._on_int)
        threading.Thread(target=self._reader, name="taas-host-reader", daemon=True).start()

    # -- the reader thread ---------------------------------------------------------------------
    def _reader(self) -> None:
        """:meth:`_read`; whatever ends it ends this host (and so its jobs): a host left with no
        reader would wait for ever, its start process and ranks with it, after its kernel died."""
        try:
            self._read()
        except BaseException:
            log.exception("the job host's reader failed: the host ends, and its jobs with it")
        os._exit(1)

    def _read(self) -> None:
        watched = [self.sock] + ([self.kernel] if self.kernel is not None else [])
        while True:
            try:
                ready = readable(watched)
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
        # Between jobs SIGINT is ours (_on_int, which never raises: a KeyboardInterrupt outside
        # a job would end the host); while a job runs it is Python's, so that the steps the
        # supervisor and the launcher shield (taas.shield.deferred_interrupt) are never cut.
        signal.signal(signal.SIGINT, self._on_int)
        while True:
            try:
                self._serve_one()
            except KeyboardInterrupt:  # one that came as a job ended, before ours was back
                signal.signal(signal.SIGINT, self._on_int)

    def _serve_one(self) -> None:
        item = self.jobs.get()
        if isinstance(item[0], KeptCall):
            self._call(item[0])
            return
        answered: list = []
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.early:  # its Interrupt came while it waited to be taken
                self.early = False
                raise KeyboardInterrupt
            self._run(*item, answered=answered)
        except KeyboardInterrupt:  # an Interrupt that came just before the job ran
            if not answered:
                unrun = Run(self.launcher, *item, None, self.labels, kept=self.kept)
                unrun.close_fds()
                self._answer(unrun, KeyboardInterrupt(), answered)
        finally:
            signal.signal(signal.SIGINT, self._on_int)

    def _run(self, message: RunJob, body: bytes, fds: list[int], answered: list) -> None:
        while not self.answers.empty():  # answers to a job before this one
            self.answers.get_nowait()
        run = Run(self.launcher, message, body, fds, AskingSink(self.sock, message.in_place, self.answers),
                  self.labels, kept=self.kept)
        try:
            run.run()
            self._answer(run, None, answered)
        except BaseException as exc:  # what the notebook shows, whatever it was
            self._answer(run, exc, answered)
        finally:
            self.kept = run.kept

    def _answer(self, run: Run, exc: BaseException | None, answered: list) -> None:
        with deferred_interrupt():  # the answer's frames go whole, once (a late Interrupt is dropped)
            if answered:
                return
            answered.append(True)
            self.busy = False  # before the answer: the kernel's next RunJob may follow at once
            self.kept = run.kept
            answer(self.sock, run, exc)

    def _call(self, message: KeptCall) -> None:
        """A question about the kept ranks, or their release, between cells."""
        kept = self.kept
        if message.call == "release":
            self.kept = None
        value: object = None
        try:  # a release's merge notes go to the kernel's sink
            value = kept_call(kept, message.call, AskingSink(self.sock, True, self.answers))
        except Exception as exc:  # the kernel asked between cells: it gets what went wrong
            log.debug("kept ranks, %s: %r", message.call, exc)
        try:
            channel.send(self.sock, KeptAnswer(value))
        except OSError:  # the kernel is gone: the reader thread ends this host
            pass

    def _on_int(self, signum, frame) -> None:
        if self.busy:  # the kernel's Interrupt for the job it just sent, not taken yet: noted
            self.early = True


def main(argv: list[str]) -> None:
    from taas.wiring import launcher_from_env

    sock = socket.socket(fileno=int(argv[0]))
    end_with(int(argv[1]))
    launcher = launcher_from_env()
    launcher.warm()  # the start process imports torch while the kernel waits for its first cell
    preload()
    Serving(sock, int(argv[1]), launcher).serve()


def end_with(kernel_pid: int) -> None:
    """From now on, the kernel's end ends this host at once, whatever it is doing: starting its
    start process and importing torch take seconds before :class:`Serving`'s reader watches,
    and a kernel killed meanwhile must leave nothing within seconds (a loaded machine took
    longer than 5 s to get there)."""
    try:
        kernel = os.pidfd_open(kernel_pid)
    except ProcessLookupError:
        os._exit(0)  # gone already
    except (OSError, AttributeError):  # no pidfd here: the reader's socket says it, once serving
        return

    def watch() -> None:
        wait_readable(kernel, None)
        os._exit(0)  # the launcher's guard ends the start process and the ranks

    threading.Thread(target=watch, name="taas-host-kernel", daemon=True).start()


def preload() -> None:
    """What a job imports here, imported before the first one comes: the first cell would
    otherwise wait for torch (its rendezvous store: benchmarks/launch.py's "first" cell, 1.4 s
    against 0.34 s), shielded (a module left half imported would fail every later job)."""
    from taas.shield import import_shielded

    import_shielded("torch.distributed", "taas.supervisor.supervisor", "taas.supervisor.cell", "taas.host.wire")


if __name__ == "__main__":
    logging.basicConfig(level=logging.DEBUG if os.environ.get("TAAS_HOST_DEBUG") else logging.WARNING,
                        format="%(asctime)s taas-host %(name)s: %(message)s")
    main(sys.argv[1:])
