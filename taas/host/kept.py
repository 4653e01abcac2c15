"""A kept job's host (``--keep --detach``): the kept ranks wait for a notebook that adopts them.

After the job's first cell the ranks stay (the host's Session keeps them, as a kernel's does)
and the record reads ``kept``.  The host then listens at its door: on this machine its socket
(:class:`taas.host.channel.UnixDoor`), on a Ray cluster a TCP port of its node
(taas.host.ray.door).  One kernel at a time adopts the ranks (``%taas attach ID``) by proving
the job's secret, and
sends each later cell; the host runs it on the kept ranks and streams every Sink call back as
it happens (also into the record's log, for ``taas logs``), then rank 0's names and Out[] or
the failure.  An Interrupt interrupts the cell, not the ranks' life.

    events (one queue, the main thread serves them in order)
      ("adopted", conn)           a kernel proved the secret: its reader thread runs
      (RunCell | Release, body)   from the adopting kernel
      ("gone", conn)              its socket closed (the kernel ended, ``%unload_ext``): the
                                  ranks wait for the next one
    the idle limit (the Session's Keeper) ends the ranks while nobody uses them

The host ends with the kept ranks: released (``done``), their idle limit (``done``), a cancel
(``cancelled``: SIGTERM, or :meth:`KeptHost.cancel`).  Its death (SIGKILL) ends them as a
kernel's does (the launcher's guard).  :meth:`KeptHost.serve` runs in the host's main thread
(an interrupt is a SIGINT, as in a kernel) or in another (a Ray actor's: taas.shield's
``interrupt_thread``).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import signal
import socket
import threading
import time

from taas.host import channel
from taas.host.api import (CellDone, CellFailed, Ended, Hello, Interrupt, Metrics, Refused, Release, Request,
                           RunCell, Show, Welcome)
from taas.host.cells import failure_of, run_request
from taas.jobs.api import State
from taas.shield import forget_interrupt, interrupt_thread

log = logging.getLogger(__name__)

GREET_WAIT = 5.0  # seconds a connection has to prove the secret
RELEASED = "were released (%taas release)"


class KeptHost:
    def __init__(self, session, store, record, namespace: dict, record_sink, door=None):
        """``door``: where kernels connect (``listener``, ``token``, ``admits(conn)``,
        ``close()``); default: the socket in the job's folder on this machine."""
        self.session, self.store, self.record = session, store, record
        self.namespace, self.record_sink = namespace, record_sink
        self.door = door if door is not None else channel.UnixDoor(store.folder(record.id))
        self.token, self.listener = self.door.token, self.door.listener
        self._server: int | None = None  # the thread that serves (runs the cells)
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.holder: socket.socket | None = None
        self.who = ""
        self.busy = False  # a cell runs: an Interrupt interrupts it
        self.cancelled = False
        threading.Thread(target=self._accept, name="taas-kept-accept", daemon=True).start()

    # -- connections (threads) ---------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # the listener closed: the ranks ended
            threading.Thread(target=self._greet, args=(conn,), name="taas-kept-conn", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """The secret first; then this connection adopts the ranks if nobody holds them."""
        job = self.record.id
        try:
            conn.settimeout(GREET_WAIT)
            if not self.door.admits(conn):
                raise PermissionError("another user")
            hello, body = channel.recv(conn, channel.HELLO_LIMIT, 0)
            if not isinstance(hello, Hello) or not channel.proves(self.token, hello.token):
                log.debug("a connection did not prove the secret")
                channel.send(conn, Refused(f"taas: job {job} refused the connection: wrong secret"))
                raise PermissionError("wrong secret")
            with self._lock:
                if self.holder is not None:
                    channel.send(conn, Refused(
                        f"taas: job {job}'s kept ranks are held by {self.who}; %taas release there "
                        "(or end that kernel), then attach again"))
                    raise PermissionError("held")
                self.holder = conn
                self.who = f"kernel pid {hello.pid}" + (f" ({hello.notebook})" if hello.notebook else "")
            conn.settimeout(None)
            world = self.session.kept.world if self.session.kept else None
            channel.send(conn, Welcome(job, world.size if world else 0, world.device if world else "",
                                       world.backend if world else ""))
        except (OSError, EOFError, channel.ProtocolError, PermissionError):
            with self._lock:
                if self.holder is conn:  # it went before it was welcome: nobody holds the ranks
                    self.holder, self.who = None, ""
            with contextlib.suppress(OSError):
                conn.close()
            return
        log.debug("adopted by %s", self.who)
        self.events.put(("adopted", conn, None))
        self._read(conn)

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                message, body = channel.recv(conn)
            except (OSError, EOFError, channel.ProtocolError):
                break
            if isinstance(message, Interrupt):
                self._interrupt()
                continue
            self.events.put((message, conn, body))
        with self._lock:
            if self.holder is conn:
                self.holder, self.who = None, ""
        self.events.put(("gone", conn, None))

    # -- the main thread ---------------------------------------------------------------------
    def serve(self, ready=None):
        """Serve the kept ranks until they end; the job's final record.  ``ready()``: called once
        a cancel (SIGTERM) is this loop's (the host says the ranks are kept then)."""
        self._server = threading.get_ident()
        main = self._server == threading.main_thread().ident
        if main:
            signal.signal(signal.SIGTERM, self._on_term)
            signal.signal(signal.SIGINT, self._on_int)
        job, world = self.record.id, self.session.kept.world
        what = f"the kept ranks ({world.size} on {world.device}/{world.backend})"
        try:
            if ready is not None:
                ready()
            state, cause = self._loop()
        except KeyboardInterrupt:  # a cancel (during a cell, too)
            state, cause = State.CANCELLED, "cancelled"
        finally:
            if main:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the end is written whole
            released = self.session.release()
            self.door.close()
        if state is State.CANCELLED:
            line = f"taas: job {job} was cancelled: {what} ended"
        elif cause == RELEASED and released:
            line = f"{released} of job {job}"
        else:
            line = f"taas: {what} of job {job} {cause}"
        self._tell(Ended(line))
        log.debug("kept ranks ended: %s", line)
        return self._now().replace(state=state, cause=cause if state is State.CANCELLED else f"the kept ranks {cause}")

    def _loop(self) -> tuple[State, str]:
        last = self.session.kept
        while True:
            kept = self.session.kept
            if self.cancelled:
                return State.CANCELLED, "cancelled"
            if kept is None and not last.expired():  # a cell lost them
                return State.DONE, "ended"
            last = kept or last
            if last.expired():  # the Keeper's timer ended them, or does now
                return State.DONE, f"were released after their idle limit ({last.flag()})"
            left = last.limit - last.idle()
            try:
                what, conn, body = self.events.get(timeout=None if left == float("inf") else left + 0.05)
            except queue.Empty:
                continue
            if what == "cancel":
                continue  # the loop's top says cancelled
            if what == "gone":
                log.debug("the adopting kernel left; the ranks wait")
                with contextlib.suppress(OSError):
                    conn.close()
            elif conn is not self.holder:
                continue  # from a kernel that let go since
            elif isinstance(what, RunCell):
                self._cell(conn, what, body)
            elif isinstance(what, Release):
                return State.DONE, RELEASED

    def _cell(self, conn: socket.socket, message: RunCell, body: bytes) -> None:
        from taas.job.metrics import HISTORY

        wire = WireSink(conn, message.in_place)
        sink = Tee(wire, self.record_sink)
        observers = (self.record_sink.metrics, wire.metrics)
        HISTORY.observers.extend(observers)
        try:
            request: Request = pickle.loads(body)
            self.busy = True
            main = threading.current_thread() is threading.main_thread()
            if main:  # Python's own SIGINT handler while the cell runs: the steps the supervisor
                # and the launcher shield (taas.shield.deferred_interrupt) are then never cut.
                signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                returned = run_request(self.session, self.namespace, request, sink)
            finally:
                if main:
                    signal.signal(signal.SIGINT, self._on_int)
            self.busy = False
            wire.send(CellDone(), pickle.dumps(returned))
        except BaseException as exc:  # what the notebook shows, whatever it was
            self.busy = False
            if isinstance(exc, KeyboardInterrupt) and self.cancelled:
                raise
            failure = failure_of(exc)
            wire.send(CellFailed(failure.summary, list(failure.rendered), failure.kind))
        finally:
            with self._lock:  # an interrupt that came as the cell ended is not the next one's
                self.busy = False
                forget_interrupt()
            for observer in observers:
                HISTORY.observers.remove(observer)

    def _interrupt(self) -> None:
        """Interrupt the running cell (not the ranks' life); nothing when no cell runs."""
        with self._lock:
            if not self.busy or self._server is None:
                return
            if self._server == threading.main_thread().ident:
                signal.pthread_kill(self._server, signal.SIGINT)
            else:
                interrupt_thread(self._server)

    def cancel(self) -> None:
        """End the kept ranks (a cancel, when the host is not a process of its own that SIGTERM
        reaches): a running cell is interrupted, then the ranks are released."""
        self.cancelled = True
        self._interrupt()
        self.events.put(("cancel", None, None))

    def _on_term(self, signum, frame) -> None:
        self.cancelled = True
        raise KeyboardInterrupt("cancelled")

    def _on_int(self, signum, frame) -> None:
        if self.busy:  # an Interrupt from the adopting kernel: only a running cell hears it
            raise KeyboardInterrupt

    def _tell(self, message) -> None:
        with self._lock:
            conn = self.holder
        if conn is not None:
            with contextlib.suppress(OSError):
                channel.send(conn, message)

    def _now(self):
        try:
            return self.store.read(self.record.id).replace(ended=time.time())
        except Exception:  # the record as we had it is the next best
            return self.record.replace(ended=time.time())


class WireSink:
    """The Sink calls of one cell, sent to the adopting kernel as they happen.  A kernel that is
    gone meanwhile costs nothing: the cell goes on (its output is in the record's log)."""

    def __init__(self, conn: socket.socket, in_place: bool):
        self.conn = conn
        self.updates_in_place = in_place
        self.gone = False
        self._lock = threading.Lock()  # the supervisor's and the plot's threads both show

    def send(self, message, body: bytes = b"") -> None:
        if self.gone:
            return
        try:
            with self._lock:
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


class Tee:
    """One Sink that is two: the adopting kernel's and the record's."""

    def __init__(self, first: WireSink, second):
        self.first, self.second = first, second
        self.updates_in_place = first.updates_in_place

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
