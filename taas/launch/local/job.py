"""One running attempt on this machine: the :class:`~taas.launch.api.JobHandle` of the local launcher.

The job reads its processes' pipes (three per process: stdout, stderr, events) itself, so output
streams straight from each process to the kernel, and it reads the start process's answers about
it (:mod:`taas.launch.local.protocol`) from the channel it shares with the launcher.  It knows
the launcher only as that channel and one callback for when the start process is lost.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection

from taas.errors import KeptRanksGone, LaunchError
from taas.launch.api import Event, JobHandle, OutputChunk, ProcessExit
from taas.launch.local import jobdir, protocol
from taas.launch.local.mailboxes import Mailboxes
from taas.launch.process import cells
from taas.launch.local.protocol import (
    Exited,
    Message,
    Spawned,
    SpawnError,
    Stop,
    Stopped,
)
from taas.shield import deferred_interrupt

log = logging.getLogger(__name__)


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _unreachable(exc: OSError) -> str:
    return f"{exc.filename} cannot be reached ({exc.strerror})"


def _remove(folder: str, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass


_SPAWN_TIMEOUT = 30.0  # seconds of silence from the start process before a start is given up


class LocalJob(JobHandle):
    def __init__(self, conn: Connection, lose_starter: Callable[[], None], job_id: str,
                 readers: dict[int, tuple[str, str]], job_dir: str, store=None,
                 mailboxes: Mailboxes | None = None):
        self._conn = conn  # the launcher's channel to the start process
        # Answers about this job that another live job of the launcher read (kept ranks and a
        # cell's loader job run side by side): taas.launch.local.mailboxes.
        self._mail = mailboxes if mailboxes is not None else Mailboxes()
        self._box = self._mail.open(job_id)
        self._close_starter = lose_starter  # the start process is gone or stuck: start afresh
        self.job_dir = job_dir  # see taas.launch.local.jobdir
        self._store = store  # the attempt's rendezvous store; its port closes with it
        self.job_id = job_id
        self._readers = readers
        self._selector = selectors.DefaultSelector()
        for fd in readers:
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ)
        self._selector.register(self._conn.fileno(), selectors.EVENT_READ)
        self._pids: dict[str, int] = {}
        self._exited: set[str] = set()
        self._pending: list[Event] = []
        self._stopped = False
        self._starter_lost = False

    @property
    def pids(self) -> dict[str, int]:
        return dict(self._pids)

    @property
    def keys(self) -> list[str]:
        return list(self._pids)

    def fetch(self, key: str, name: str) -> bytes | None:
        return jobdir.read(self.job_dir, name) if self.job_dir else None

    def request_stacks(self, keys) -> list[str]:
        from taas.launch.process import stacks

        return stacks.request(self.job_dir, keys) if self.job_dir else []

    def layers(self) -> list[tuple[str, str]]:
        return jobdir.layers(self.job_dir) if self.job_dir else []

    def answer(self, key: str, reply) -> bool:
        from taas.launch.process import stdin

        return bool(self.job_dir) and key in self._pids and stdin.answer(self.job_dir, key, reply)

    def fileno(self) -> int | None:
        """The selector's descriptor: readable when a pipe or the start process's channel is
        (what another job routed here is not: :meth:`events` takes that first)."""
        try:
            return self._selector.fileno()  # type: ignore[attr-defined]
        except (AttributeError, ValueError, OSError):  # no such selector here, or closed
            return None

    @property
    def running(self) -> bool:
        return len(self._exited) < len(self._pids)

    @property
    def finished(self) -> bool:
        """Every process exited and all its output was read: :meth:`events` has nothing more."""
        return not self._readers and not self.running

    # -- the start process's answers -------------------------------------------------------
    def await_spawned(self) -> None:
        """Wait for the start process to answer this job's Spawn: its pids, or a LaunchError.
        Messages about other jobs, and unreadable ones, do not end the wait."""
        deadline = time.monotonic() + _SPAWN_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._starter_lost:
                raise LaunchError("the taas start process did not answer; run the cell again")
            if self._box:
                received, message = True, self._box.popleft()
            else:
                received, message = self._recv_control(remaining)
            if not received:
                continue
            deadline = time.monotonic() + _SPAWN_TIMEOUT  # it answers: wait on
            if getattr(message, "job_id", self.job_id) != self.job_id:
                self._mail.route(message)  # another live job's (kept ranks'), or dropped
                continue
            if isinstance(message, Spawned) and message.job_id == self.job_id:
                self._pids = dict(message.pids)
                return
            if isinstance(message, SpawnError) and message.job_id == self.job_id:
                self.close()
                if message.replace:  # it is exiting (forksafe): the next job starts a new one
                    self._close_starter()
                raise LaunchError(message.message)

    def _recv_control(self, timeout: float) -> tuple[bool, Message | None]:
        """(whether a frame arrived, its message or None if unreadable) within ``timeout``."""
        try:
            if self._conn.poll(timeout):
                with deferred_interrupt():  # never half a message
                    return True, protocol.receive(self._conn)
        except (EOFError, OSError):
            self._lose_starter()
        return False, None

    def _lose_starter(self) -> None:
        """The start process is gone (or we killed it): so are its children (PDEATHSIG)."""
        self._starter_lost = True
        for key, pid in self._pids.items():
            if key not in self._exited:
                self._exited.add(key)
                self._pending.append(ProcessExit(key, pid, -9))
        if self._conn is not None and self._conn.fileno() in self._selector.get_map():
            self._selector.unregister(self._conn.fileno())
        self._close_starter()

    def _handle_control(self, message: Message | None) -> None:
        if getattr(message, "job_id", self.job_id) != self.job_id:
            self._mail.route(message)  # another live job's, or a late one about an ended job
        elif isinstance(message, Exited):
            self._exited.add(message.key)
            self._pending.append(ProcessExit(message.key, message.pid, message.returncode))
        elif isinstance(message, Stopped):
            self._stopped = True
        elif message is not None and not isinstance(message, (Spawned, SpawnError)):
            log.debug("taas: a job ignored a %s from the start process", type(message).__name__)

    # -- output ----------------------------------------------------------------------------
    def events(self, timeout: float) -> Iterable[Event]:
        if not self._pending:
            self._poll(timeout)
        out, self._pending = self._pending, []
        return out

    def _poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output or control messages; queue what arrives."""
        if self._box:  # what another job read for us first; then no waiting
            while self._box:
                self._handle_control(self._box.popleft())
            timeout = 0
        if self._readers or self.running or not self._stopped:
            for sel_key, _ in self._selector.select(timeout):
                fd = sel_key.fd
                if self._conn is not None and not self._starter_lost and fd == self._conn.fileno():
                    while not self._starter_lost and self._conn.poll(0):
                        received, message = self._recv_control(0)
                        if received:
                            self._handle_control(message)
                    continue
                self._read(fd)

    def _read(self, fd: int) -> None:
        key, stream = self._readers[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self._pending.append(OutputChunk(key, stream, data))
        else:
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        """Stop reading the pipe ``fd`` and close it, as one step: a Ctrl-C halfway would leave
        it closed but listed, and :meth:`close` would close that number again (by then another
        file's) or fail the job's clean-up on an fd no longer registered."""
        with deferred_interrupt():
            if self._readers.pop(fd, None) is None:
                return
            try:
                self._selector.unregister(fd)
            except (KeyError, ValueError):  # never registered, or the selector is closed
                pass
            os.close(fd)

    # -- kept ranks (taas.launch.api: next_cell, interrupt) ----------------------------------
    def lost(self) -> str | None:
        why = self._ended() or self._ending()
        if why is not None:
            return why
        # A rank gone a moment ago is unreachable before the start process reports its exit.
        why = cells.unreachable(self.job_dir, self._kept_ranks())
        if why is not None:
            return _unreachable(why)
        return None

    def _ended(self) -> str | None:
        """Why the kept ranks are gone as far as the start process told us, or None."""
        self._poll(0)  # exits since the last cell (their output stays queued for events())
        gone = [e for e in self._pending if isinstance(e, ProcessExit)]
        if gone:
            return f"{gone[0].key} ended ({_how(gone[0].returncode)})"
        if self._starter_lost or self._stopped or not self.job_dir:
            return "the job's processes were stopped"
        return None

    def _ending(self, ranks: list[str] | None = None) -> str | None:
        """A kept rank (of ``ranks``, default all) whose process is ending (cells.ending), not
        reaped yet: it will run no cell."""
        ranks = self._kept_ranks() if ranks is None else ranks
        return cells.ending({k: self._pids[k] for k in ranks if k not in self._exited})

    def _kept_ranks(self) -> list[str]:
        """The processes that are kept ranks: each made its cell FIFO."""
        return [k for k in self._pids if os.path.exists(cells.fifo_path(self.job_dir, k))]

    def next_cell(self, files: dict[str, bytes], payload: str, result: str) -> None:
        # lost()'s checks, with the ranks' FIFOs opened once: the reachability check is the
        # opening of the FIFOs the cell then goes through (a FIFO with no reader fails to open).
        ranks = self._kept_ranks()
        lost = self._ended() or self._ending(ranks)
        if lost is not None:
            raise KeptRanksGone(lost)
        try:
            fds = cells.open_all(self.job_dir, ranks)
        except OSError as exc:
            # Gone before its exit reached us (the start process reports it a moment later):
            # nothing was sent, so the cell can still run on fresh ranks.
            raise KeptRanksGone(_unreachable(exc)) from None
        try:
            stale = [name for name in os.listdir(self.job_dir)
                     if name.endswith((".error.json", ".pkl", ".pkl.tmp")) and name not in files and name != result]
            _remove(self.job_dir, [n for n in stale if n.endswith(".error.json")])  # must not name this cell
            jobdir.write_files(self.job_dir, files)
            try:
                cells.write_all(fds, cells.NextCell(payload, result))
            except OSError as exc:  # a rank went between the opening and the writing
                raise KeptRanksGone(_unreachable(exc)) from None
        finally:
            cells.close_all(fds)
        # The last cell's payload and results go while the ranks run this one (the ranks are
        # done with them, and no name of this cell is among them).
        _remove(self.job_dir, [n for n in stale if not n.endswith(".error.json")])

    def interrupt(self, keys: Iterable[str]) -> list[str]:
        sent = []
        for key in keys:
            pid = self._pids.get(key)
            if pid is None or key in self._exited:
                continue
            try:
                os.kill(pid, signal.SIGINT)
                sent.append(key)
            except ProcessLookupError:
                pass
        return sent

    def running_pids(self) -> dict[str, int]:
        return {k: p for k, p in self._pids.items() if k not in self._exited}

    def memory(self) -> dict[str, int]:
        out = {}
        for key, pid in self.running_pids().items():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    out[key] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):  # ended meanwhile
                pass
        return out

    # -- the end ---------------------------------------------------------------------------
    def stop(self, grace: float = 1.0) -> None:
        if self._stopped or self._starter_lost or not self._pids:
            return
        if self.running:
            try:
                with deferred_interrupt():
                    protocol.send(self._conn, Stop(self.job_id, grace))
            except OSError:
                self._recv_control(0)
                return
            deadline = time.monotonic() + grace + 5
            while not self._stopped and not self._starter_lost:
                if time.monotonic() > deadline:
                    # Never leave a job behind: kill the start process, its children die too.
                    self._lose_starter()
                    break
                self._poll(0.05)
        self._stopped = True

    def drain(self, timeout: float = 2.0) -> list[Event]:
        """Read what is left in the pipes after every process exited."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout
        while self._readers and time.monotonic() < deadline:
            out.extend(self.events(0.05))
        return out

    def close(self) -> None:
        self.stop()
        self._mail.close(self.job_id)
        for fd in list(self._readers):
            self._drop(fd)
        self._selector.close()
        self._store = None  # closes its listening port
        if self.job_dir:
            jobdir.discard(self.job_dir)
            self.job_dir = ""
