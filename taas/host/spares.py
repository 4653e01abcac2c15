"""A kernel's job hosts that have no job yet (``Hosts``), one such host (``_Spare``), and the
warm process that forks them (``_Zygote``).

A host waits on one end of a SOCK_SEQPACKET socketpair for a :class:`~taas.host.api.Take`.
With ``Hosts.prewarm`` (at ``%load_ext`` and after each ``--detach``) the kernel keeps one such
spare ready.  Spares are forked by the kernel's zygote (:mod:`taas.host.zygote`), started once
and warm from then on, so that a spare is ready in a fraction of a second however many detached
cells come back to back; until the zygote is up (or with ``TAAS_WARM_HOST=0`` before any
``--detach``) a host is started as a fresh interpreter instead, warm once it has imported torch.
An idle spare, and the zygote, end when the kernel's end of their socket closes (``close``,
``%unload_ext``, the kernel's death).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

from taas.host.api import FDS_AT_ONCE, Fork, Running, Take, decode, encode
from taas.jobs.store import JobError, Store
from taas.ready import readable

# After a detached job starts, its first moments are its own: the next spare is forked this
# much later (a detached cell before then forks one at once, so waiting hides no cost).
SETTLE = 1.0


class Hosts:
    """This kernel's job hosts that have no job yet: one kept ready for the next ``--detach``
    (forked warm by the zygote).  A spare host ends when this kernel does (its socket closes);
    :meth:`close` ends it, and the zygote, sooner."""

    def __init__(self) -> None:
        self._spare: _Spare | None = None
        self._zygote: _Zygote | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._closed = False

    def take(self, store: Store, ranks: int | None = None) -> _Spare:
        """A host to give a job to: the spare, else one forked by the zygote, else a fresh one
        (told the job's ``ranks``: its start process forks that many ahead as the job comes)."""
        with self._lock:
            spare, self._spare = self._spare, None
            zygote = self._zygote
        if spare is not None and spare.alive() and spare.root == store.root:
            return spare
        if spare is not None:
            spare.close()
        return self._new(store, zygote, ranks)

    def prewarm(self, store: Store, ranks: int | None = None, later: bool = False) -> None:
        """Have the next spare ready (the next detached cell of a Run All finds it warm), and the
        zygote that forks spares; ``ranks``: how many processes its first job likely has (the
        kernel's last job's), to have as many forked ahead; ``later``: in ``SETTLE`` seconds (after a
        detached cell: its job's first moments are its own)."""
        if later and SETTLE > 0:
            timer = threading.Timer(SETTLE, self.prewarm, (store, ranks))
            timer.daemon = True
            with self._lock:
                old, self._timer = self._timer, (None if self._closed else timer)
            if old is not None:
                old.cancel()
            if self._timer is timer:
                timer.start()
            return
        with self._lock:
            if self._closed:
                return
            zygote = self._zygote
            if zygote is None or not zygote.alive():
                if zygote is not None:
                    zygote.close()
                try:
                    zygote = self._zygote = _Zygote(store)
                except (OSError, JobError):
                    zygote = self._zygote = None
        try:
            spare = self._new(store, zygote, ranks) if zygote is not None else None
        except (OSError, JobError):  # no spare: the next detached cell starts one
            return
        with self._lock:
            old, self._spare = self._spare, (None if self._closed else spare)
        for extra in (old, spare if self._closed else None):
            if extra is not None:
                extra.close()

    def _new(self, store: Store, zygote: _Zygote | None, ranks: int | None = None) -> _Spare:
        if zygote is not None and zygote.alive():
            try:
                return _Spare(store, ranks, zygote)
            except OSError:
                pass  # the zygote just went: a fresh interpreter
        return _Spare(store, ranks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
            zygote, self._zygote = self._zygote, None
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        for closable in (spare, zygote):
            if closable is not None:
                closable.close()


def _hosts_folder(store: Store) -> pathlib.Path:
    hosts = store.ensure() / ".hosts"
    hosts.mkdir(mode=0o700, exist_ok=True)
    return hosts


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` closed (it exited), without taking a message."""
    try:
        ready = readable([sock], 0)
        if not ready:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True


def _started(args: list[str], env: dict, log: pathlib.Path, fd: int) -> subprocess.Popen:
    out = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        process = subprocess.Popen(
            args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, close_fds=True,
            pass_fds=(fd,), start_new_session=True)
    finally:
        os.close(out)
    # Reaped when it ends while this process lives; if this process dies first, init reaps it.
    threading.Thread(target=process.wait, name="taas-host", daemon=True).start()
    return process


class _Zygote:
    """The kernel's warm process that forks job hosts (:mod:`taas.host.zygote`)."""

    def __init__(self, store: Store):
        folder = _hosts_folder(store)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = folder / f"zygote-{os.getpid()}-{time.monotonic_ns()}.log"  # a crash of taas itself
        try:
            env = dict(os.environ, TAAS_ZYGOTE_SOCKET=str(theirs.fileno()), TAAS_ZYGOTE_LOG=str(self.log))
            self.process = _started([sys.executable, "-m", "taas.host.zygote"], env, self.log, theirs.fileno())
        finally:
            theirs.close()

    def alive(self) -> bool:
        return self.process.poll() is None and not _peer_gone(self.sock)

    def fork(self, host_end: int, log: int, ranks: int | None, env: dict) -> None:
        socket.send_fds(self.sock, [encode(Fork(env, ranks or 0))], [host_end, log])

    def close(self) -> None:
        """It exits when its socket closes (and removes its log unless it said something)."""
        self.sock.close()


class _Spare:
    """A job host started for this kernel (forked by ``zygote``, else started fresh), waiting
    on its socket for a job."""

    def __init__(self, store: Store, ranks: int | None = None, zygote: _Zygote | None = None):
        self.root = store.root
        # Its stderr until it has a job (then the record's host.log): a crash of taas itself.
        log = _hosts_folder(store) / f"{os.getpid()}-{time.monotonic_ns()}.log"
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process: subprocess.Popen | None = None
        try:
            env = dict(os.environ, TAAS_HOST_LOG=str(log))
            if zygote is not None:
                out = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    zygote.fork(theirs.fileno(), out, ranks, env)
                finally:
                    os.close(out)
            else:
                env["TAAS_HOST_SOCKET"] = str(theirs.fileno())
                if ranks:
                    env["TAAS_READY_HINT"] = str(ranks)
                self.process = _started([sys.executable, "-m", "taas.host"], env, log, theirs.fileno())
        except OSError:
            self.sock.close()
            raise
        finally:
            theirs.close()

    def alive(self) -> bool:
        return (self.process is None or self.process.poll() is None) and not _peer_gone(self.sock)

    def give(self, folder: pathlib.Path, lock: int, fds=()) -> None:
        """The job in ``folder``, its record's ``lock`` (held for the host from now on) and a
        prepared job's shared files ``fds``."""
        fds = list(fds)
        socket.send_fds(self.sock, [encode(Take(str(folder), len(fds)))], [lock, *fds[:FDS_AT_ONCE - 1]])
        for at in range(FDS_AT_ONCE - 1, len(fds), FDS_AT_ONCE):  # SCM_RIGHTS carries 253 at most
            socket.send_fds(self.sock, [b"F"], fds[at:at + FDS_AT_ONCE])

    def wait(self, timeout: float) -> Running | None:
        """The host's next word within ``timeout`` s; ``Running(ended=True)`` if it is gone."""
        ready = readable([self.sock], timeout)
        if not ready:
            return None
        try:
            data = self.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            return Running("", ended=True)
        message = decode(data)
        return message if isinstance(message, Running) else None

    def close(self) -> None:
        """Let it go: an idle host exits when its socket closes; one with a job goes on."""
        self.sock.close()
