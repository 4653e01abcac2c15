"""The kernel's side of a kept job (``--keep --detach``): adopt its kept ranks, run cells on them.

``%taas attach ID`` on a job whose record reads ``kept`` connects to the host's socket, proves
the job's secret and, when no other kernel holds the ranks, makes them this kernel's
(:class:`Adopted`).  Each later taas cell is sent to the host (:meth:`Adopted.run`): what the
cell shows arrives as the host's Sink calls and is replayed on this notebook's sink as it
comes, then rank 0's names and Out[] (or the failure, raised as an attached cell's).  Ctrl-C
sends an Interrupt: the cell is interrupted on the ranks, which stay.  Closing the connection
(``%unload_ext``, the kernel's death) lets the ranks wait for the next kernel.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import socket
import threading
import weakref

from taas.errors import JobFailed, LaunchError
from taas.host import channel
from taas.host.api import (SHOWN, CellDone, CellFailed, Ended, Hello, Interrupt, Metrics, Refused, Release,
                           Request, Returned, RunCell, Show, Welcome)
from taas.jobs.store import JobError, Store
from taas.supervisor.kept import fingerprint

log = logging.getLogger(__name__)


class Held:
    """What the kept ranks' host holds of the notebook's values (as a kernel's kept ranks do,
    :class:`taas.supervisor.kept.Kept`): a value it holds unchanged is not sent again, so a
    cell that reads a big model the ranks have costs nothing for it."""

    def __init__(self) -> None:
        self._held: dict[str, tuple] = {}
        self.sending: dict = {}  # the values the cell being sent carries

    def lacking(self, values: dict) -> dict:
        """``values`` less the ones held unchanged; remembered as being sent."""
        self.sending = {k: v for k, v in values.items() if not self.holds(k, v)}
        return self.sending

    def holds(self, name: str, value) -> bool:
        entry = self._held.get(name)
        if entry is None:
            return False
        print_, ref = entry
        # The weak reference rules out a new object that reuses a freed one's id.
        return (ref is None or ref() is value) and print_ == fingerprint(value)

    def remember(self, values: dict) -> None:
        """The host holds ``values`` now (sent with a cell that ran, or brought back by it)."""
        for name, value in values.items():
            try:
                ref = weakref.ref(value)
            except TypeError:  # no weak references (ints, tuples...): its fingerprint says it all
                ref = None
            self._held[name] = (fingerprint(value), ref)


class Adopted:
    """This kernel's hold on a kept job's ranks, through the host's socket."""

    def __init__(self, store: Store, job_id: str, notebook: str = "", knock=None):
        """``knock()``: (a connection to the host, the secret to prove), OSError when the host
        is gone; default: the socket in the job's folder on this machine (channel.knock)."""
        self.job = job_id
        try:
            self.sock, token = knock() if knock is not None else channel.knock(store.folder(job_id))
        except OSError:
            raise JobError(f"taas: job {job_id}'s kept ranks cannot be reached: their host is gone "
                           f"(`taas jobs` says how it ended)") from None
        try:
            channel.send(self.sock, Hello(token, os.getpid(), notebook))
            answer, _ = channel.recv(self.sock)
        except (OSError, EOFError, channel.ProtocolError) as exc:
            self.sock.close()
            raise JobError(f"taas: job {job_id}'s host did not answer: {exc}") from None
        if not isinstance(answer, Welcome):
            self.sock.close()
            raise JobError(answer.line if isinstance(answer, Refused) else
                           f"taas: job {job_id}'s host answered {type(answer).__name__}")
        self.welcome: Welcome = answer
        self.ended: str | None = None  # the host's last word: the ranks ended
        self.held = Held()

    def describe(self) -> str:
        w = self.welcome
        return f"{w.ranks} on {w.device}/{w.backend}"

    def gone(self) -> str | None:
        """Before a cell: the line saying the kept ranks ended meanwhile (their idle limit, a
        cancel, the host killed), or None when they wait for this cell."""
        if self.ended is None:
            ready, _, _ = select.select([self.sock], [], [], 0)
            if ready:
                try:
                    self._next()
                except JobError:  # closed without a word: ``ended`` says so
                    pass
        return self.ended

    def run(self, request: Request, sink, in_place: bool = True, on_metrics=None) -> Returned:
        """``request``'s cell on the kept ranks, shown on ``sink`` as it runs; rank 0's names and
        Out[].  Raises the cell's failure as an attached cell would, KeyboardInterrupt after an
        interrupt (the ranks stay), JobError when the ranks ended under the cell."""
        try:
            channel.send(self.sock, RunCell(in_place), pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._lost()
        while True:
            try:
                select.select([self.sock], [], [])  # nothing read yet: an interrupt may land here
            except KeyboardInterrupt:  # the notebook's interrupt: the cell's, not the ranks'
                self._interrupt()
                continue
            noted: list = []
            with _noting(noted):  # a frame read and shown whole, or the stream loses its place
                message, body = self._next()
                if isinstance(message, Show) and message.call in SHOWN:
                    self._show(sink, message)
                elif isinstance(message, Metrics) and on_metrics is not None:
                    on_metrics(self.job, message.rank, [(step, values) for step, values in message.rows])
            if noted:
                self._interrupt()
            if isinstance(message, CellDone):
                self.held.remember(self.held.sending)  # in the host's namespace now
                return pickle.loads(body)
            if isinstance(message, CellFailed):
                raise _failure(message)
            if isinstance(message, Ended):
                raise JobError(message.line)

    def _show(self, sink, message: Show) -> None:
        show = getattr(sink, message.call, None)
        if show is None:
            return
        try:
            show(*message.args)
        except Exception as exc:  # a call this sink cannot show costs itself, never the stream
            log.debug("job %s: %s(...) not shown: %r", self.job, message.call, exc)

    def _interrupt(self) -> None:
        try:
            channel.send(self.sock, Interrupt())
        except OSError as exc:
            log.debug("job %s: its socket: %r", self.job, exc)
            self._lost()

    def release(self) -> str:
        """End the kept ranks (and their host); the line saying so."""
        if self.gone() is not None:
            return self.ended or ""
        try:
            channel.send(self.sock, Release())
            while True:
                message, _ = self._next()
                if isinstance(message, Ended):
                    return message.line
        except (OSError, JobError):
            return self.ended or f"taas: job {self.job}'s kept ranks had already ended"
        finally:
            self.close()

    def close(self) -> None:
        """Let go: the ranks wait for the next kernel (until their idle limit)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _next(self):
        try:
            message, body = channel.recv(self.sock)
        except (OSError, EOFError, channel.ProtocolError) as exc:
            log.debug("job %s: its socket: %r", self.job, exc)
            self._lost()
        if isinstance(message, Ended):
            self.ended = message.line
        return message, body

    def _lost(self):
        self.ended = self.ended or (f"taas: job {self.job}'s host ended without a word (killed?); its kept "
                                    "ranks ended with it")
        raise JobError(self.ended)


@contextlib.contextmanager
def _noting(noted: list):
    """SIGINT only noted in ``noted`` for the block (in the main thread, where Python's handler
    is set), so that reading a frame is never cut in half."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _failure(message: CellFailed) -> BaseException:
    """The cell's exception as the notebook shows it."""
    if message.error == "KeyboardInterrupt":
        exc = KeyboardInterrupt()
        lines = list(message.rendered)
        exc._render_traceback_ = lambda: list(lines)  # type: ignore[attr-defined]
        if len(lines) > 1:
            exc.add_note("\n".join(lines[1:]))
        return exc
    if message.error in ("JobFailed", "CellSyntaxError") or message.rendered:
        return JobFailed(message.summary, list(message.rendered) or None)
    return LaunchError(message.summary)


def run_cell(adopted: Adopted, source: str, namespace: dict, options: str, sink, *, filename: str,
             label: str | None, hidden: frozenset, name_for, on_metrics=None,
             text: str | None = None) -> tuple:
    """A notebook cell on ``adopted`` kept ranks, shown on ``sink`` as it runs: rank 0's names,
    Out[], has_out and notes (:func:`taas.host.client.load`); the host holds what it sent and
    what came back, so neither is sent again while unchanged."""
    from taas.host import client, detach

    request = detach.request_for(source, namespace, options, filename=filename, label=label, first_line=2,
                                 hidden=hidden, name_for=name_for, held=adopted.held, text=text)
    loaded = client.load(adopted.run(request, sink, getattr(sink, "updates_in_place", True), on_metrics))
    adopted.held.remember(loaded[0])
    return loaded


def first_cell(store: Store, job_id: str, take=None) -> Returned | None:
    """A kept job's first cell, once, for the notebook that adopts its ranks: rank 0's names
    and Out[] (None when another notebook took them), or its failure raised.  ``take(store,
    record)``: how results are taken from this store (default: this machine's, client.take)."""
    import json

    from taas.host import client
    from taas.host.api import FAILURE

    data = store.claim(job_id, FAILURE)
    if data is not None:
        failure = json.loads(data)
        raise _failure(CellFailed(failure.get("summary", ""), list(failure.get("rendered") or ()),
                                  failure.get("kind", "JobFailed")))
    try:
        return (take or client.take)(store, store.read(job_id))
    except JobError:  # taken already (by the kernel that started it, or an earlier attach)
        return None
