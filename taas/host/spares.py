"""A kernel's job hosts that have no job yet (``Hosts``), and one such host (``_Spare``).

A host is started ahead of need, in a session of its own, with one end of a SOCK_SEQPACKET
socketpair: it makes its Session warm and waits for a :class:`~taas.host.api.Take`.  The kernel
keeps one spare warm at a time; after each ``--detach`` it starts the next.  An idle spare ends
when the kernel's end of its socket closes (``close``, ``%unload_ext``, the kernel's death).
"""

from __future__ import annotations

import os
import pathlib
import select
import socket
import subprocess
import sys
import threading
import time

from taas.host.api import Running, Take, decode, encode
from taas.jobs.store import JobError, Store


class Hosts:
    """This kernel's job hosts that have no job yet: one started ahead of need and kept warm
    (its Session's start process has torch imported) for the next ``--detach``.  A spare host
    ends when this kernel does (its socket closes); :meth:`close` ends it sooner."""

    def __init__(self) -> None:
        self._spare: _Spare | None = None
        self._lock = threading.Lock()
        self._closed = False

    def take(self, store: Store) -> _Spare:
        """A host to give a job to: the warm spare, or a new one (cold) if there is none."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.process.poll() is None and spare.root == store.root:
            return spare
        if spare is not None:
            spare.close()
        return _Spare(store)

    def prewarm(self, store: Store, ranks: int | None = None) -> None:
        """Start the next spare in the background (the next detached cell of a Run All is warm);
        ``ranks``: how many processes its first job likely has (the kernel's last job's), to
        have as many forked ahead."""
        def start() -> None:
            try:
                spare = _Spare(store, ranks)
            except (OSError, JobError):  # no spare: the next detached cell starts one cold
                return
            with self._lock:
                old, self._spare = self._spare, (None if self._closed else spare)
            for extra in (old, spare if self._closed else None):
                if extra is not None:
                    extra.close()

        threading.Thread(target=start, name="taas-spare-host", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()


class _Spare:
    """A job host started by this kernel, waiting on its socket for a job."""

    def __init__(self, store: Store, ranks: int | None = None):
        self.root = store.root
        hosts = store.ensure() / ".hosts"
        hosts.mkdir(mode=0o700, exist_ok=True)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its stderr until it has a job (then the record's host.log): a crash of taas itself.
        log = hosts / f"{os.getpid()}-{time.monotonic_ns()}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            env = dict(os.environ, TAAS_HOST_SOCKET=str(theirs.fileno()), TAAS_HOST_LOG=str(log))
            if ranks:
                env["TAAS_READY_HINT"] = str(ranks)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "taas.host"], env=env, stdin=subprocess.DEVNULL, stdout=fd,
                stderr=subprocess.STDOUT, close_fds=True, pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            os.close(fd)
            theirs.close()
        # Reaped when it ends while this process lives; if this process dies first, init reaps it.
        threading.Thread(target=self.process.wait, name="taas-host", daemon=True).start()

    def give(self, folder: pathlib.Path, lock: int) -> None:
        socket.send_fds(self.sock, [encode(Take(str(folder)))], [lock])

    def wait(self, timeout: float) -> Running | None:
        """The host's next word within ``timeout`` s; ``Running(ended=True)`` if it is gone."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
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
