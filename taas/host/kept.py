"""A kept job's host (``--keep --detach``): the kept ranks wait for a notebook that adopts them.

After the job's first cell the ranks stay (the host's Session keeps them, as a kernel's does)
and the record reads ``kept``.  The host then listens at its door: on this machine its socket
(:class:`taas.host.channel.UnixDoor`), on a Ray cluster a TCP port of its node
(taas.host.ray.door).  One kernel at a time adopts the ranks (``%taas attach ID``) by proving
the job's secret; they are that kernel's kept ranks from then on, as if its own job host kept
them: its Session prepares each later cell as a Job and sends it here, exactly as to its own
host (:mod:`taas.host.wire`: RunJob, KeptCall, JobDone), and this host runs it on the kept
ranks, streaming every Sink call back as it happens and into the record's log (for ``taas
logs``).  An Interrupt interrupts the cell, not the ranks' life.

    events (one queue, the main thread serves them in order)
      ("adopted", conn)           a kernel proved the secret: its reader thread runs
      (RunJob | KeptCall, body)   from the adopting kernel (Interrupt and Answer go straight
                                  to the running cell)
      ("gone", conn)              its socket closed (the kernel ended, ``%unload_ext``): the
                                  ranks wait for the next one
    the idle limit (the Session's Keeper) ends the ranks while nobody uses them

The host ends with the kept ranks: released (``KeptCall("release")``: ``done``), their idle
limit (``done``), a cancel (``cancelled``: SIGTERM, or :meth:`KeptHost.cancel`); the adopting
kernel is told why (:class:`~taas.host.api.Ended`).  Its death (SIGKILL) ends them as a
kernel's does (the launcher's guard).  :meth:`KeptHost.serve` runs in the host's main thread
(an interrupt is a SIGINT, as in a kernel) or in another (a Ray actor's: taas.shield's
``interrupt_thread``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import socket
import threading
import time

from taas.host import channel
from taas.host.api import Answer, Ended, Hello, Interrupt, KeptAnswer, KeptCall, Refused, RunJob, Welcome
from taas.host.wire import AskingSink, Run, Tee, answer, kept_call, metrics_frame
from taas.jobs.api import State
from taas.shield import forget_interrupt, interrupt_thread

log = logging.getLogger(__name__)

GREET_WAIT = 5.0  # seconds a connection has to prove the secret
RELEASED = "were released (%taas release)"


class KeptHost:
    def __init__(self, session, store, record, record_sink, door=None):
        """``session``: the host's, which keeps the ranks (``session.kept``); ``door``: where
        kernels connect (``listener``, ``token``, ``admits(conn)``, ``close()``); default: the
        socket in the job's folder on this machine."""
        self.session, self.store, self.record, self.record_sink = session, store, record, record_sink
        self.door = door if door is not None else channel.UnixDoor(store.folder(record.id))
        self.token, self.listener = self.door.token, self.door.listener
        self._server: int | None = None  # the thread that serves (runs the cells)
        self.events: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()  # the adopting kernel's answers to input()
        self.labels: dict[str, str] = {}  # the cells' file names -> how tracebacks name them
        self._lock = threading.Lock()
        self.holder: socket.socket | None = None
        self.who = ""
        self.busy = False  # a cell runs: an Interrupt interrupts it
        self.cancelled = False
        self._releaser: socket.socket | None = None  # the kernel that asked for the release
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
            kept = self.session.kept
            channel.send(conn, Welcome(job, kept.world.size, kept.world.device, kept.world.backend, kept.job_id,
                                       None if kept.limit == float("inf") else kept.limit, kept.cells)
                         if kept is not None else Welcome(job, 0, "", ""))
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
            elif isinstance(message, Answer):
                if conn is self.holder:
                    self.answers.put(message)
            else:
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
            releaser = self._releaser
            released = self.session.release(AskingSink(releaser, True, self.answers) if releaser else None)
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
            elif isinstance(what, RunJob):
                self._cell(conn, what, body)
            elif isinstance(what, KeptCall) and self._call(conn, what):
                return State.DONE, RELEASED

    def _cell(self, conn: socket.socket, message: RunJob, body: bytes) -> None:
        """The adopting kernel's prepared cell, on the kept ranks; its answer (JobDone)."""
        from taas.io import keys

        while not self.answers.empty():  # answers to a cell before this one
            self.answers.get_nowait()
        wire = AskingSink(conn, message.in_place, self.answers)
        job_id = self.record.id

        def on_metrics(key: str, rows) -> None:
            wire.send(metrics_frame(key, rows))
            self.record_sink.metrics(job_id, keys.rank_of(key), rows)

        keeper = self.session.keeper
        run = Run(None, message, body, [], Tee(wire, self.record_sink), self.labels, kept=self.session.kept,
                  on_metrics=on_metrics, starts=False)  # cells on the kept ranks only, never fresh ones
        failed: BaseException | None = None
        with self.session.hold():  # the idle limit's timer waits for the cell
            keeper.take(self.record_sink)
            main = threading.current_thread() is threading.main_thread()
            self.busy = True
            try:
                if main:  # Python's own SIGINT handler while the cell runs: the steps the supervisor
                    # and the launcher shield (taas.shield.deferred_interrupt) are then never cut.
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                try:
                    run.run()
                finally:
                    if main:
                        signal.signal(signal.SIGINT, self._on_int)
            except BaseException as exc:  # what the notebook shows, whatever it was
                if isinstance(exc, KeyboardInterrupt) and self.cancelled:
                    raise  # the kernel hears why from Ended
                failed = exc
            finally:
                with self._lock:  # an interrupt that came as the cell ended is not the next one's
                    self.busy = False
                    forget_interrupt()
                keeper.after_cell(run.kept, {})
        answer(conn, run, failed)

    def _call(self, conn: socket.socket, message: KeptCall) -> bool:
        """The adopting kernel's question between cells, answered; True for ``release``: the
        ranks end with the host (serve's end releases them, their merge notes shown to that
        kernel, which is then told with Ended rather than a KeptAnswer)."""
        if message.call == "release":
            self._releaser = conn
            return True
        value: object = None
        try:
            value = kept_call(self.session.kept, message.call, None)
        except Exception as exc:  # the kernel asked between cells: it gets what went wrong
            log.debug("kept ranks, %s: %r", message.call, exc)
        with contextlib.suppress(OSError):
            channel.send(conn, KeptAnswer(value))
        return False

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
