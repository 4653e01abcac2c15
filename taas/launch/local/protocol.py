"""The wire between the kernel-side launcher and the start process: typed messages, one module.

Both ends import this module and nothing else to talk to each other.  Messages travel as
pickles over a private Unix socketpair that the kernel hands to the start process at its start
(no address anyone else can reach; pickles only ever cross between these two processes)::

    starter -> kernel   Ready(pid)                                  once, when torch is imported
    kernel -> starter   Spawn(job_id, cwd, job_dir, processes, shared, cleanups)
                        then, as ancillary data on the same socket, three write-end fds per
                        process (stdout, stderr, events) and ``shared`` more
                        (LaunchSpec.shared_fds), in batches of FDS_PER_MESSAGE
    starter -> kernel   Spawned(job_id, {key: pid})  or  SpawnError(job_id, message)
    starter -> kernel   Exited(job_id, key, pid, returncode)        once per process
    kernel -> starter   Stop(job_id, grace)
    starter -> kernel   Stopped(job_id)                             once every process is gone
    starter -> child    Become(spec, cwd)       to a child forked ahead, with its fds

A message either end cannot read -- not a pickle, not one of these classes, or fields of the
wrong type -- is logged and ignored (:func:`receive` returns None): it never fails a job.  Each
class checks its own fields (:meth:`valid`), since unpickling a frozen dataclass runs none of
its code.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection

from taas.launch.api import ProcessSpec

log = logging.getLogger(__name__)

# LaunchSpec.shared_fds one job may pass: they go to a ready child in one message, with its 3 pipes.
MAX_SHARED_FDS = 64
READY_MESSAGE_MAX = 1 << 20  # bytes: the largest Become pickle a ready child reads
# How many fds one SCM_RIGHTS message may carry (Linux: SCM_MAX_FD = 253).
FDS_PER_MESSAGE = 240
# The pipes each process of a job gets, in this order.
STREAMS = ("stdout", "stderr", "events")


def _is_str_dict(value, value_type: type) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, value_type) for k, v in value.items())


@dataclass(frozen=True)
class Ready:
    """The start process imported torch and waits for jobs."""

    pid: int

    def valid(self) -> bool:
        return isinstance(self.pid, int)


@dataclass(frozen=True)
class Spawn:
    """Start a job's processes.  ``shared``: how many LaunchSpec.shared_fds follow the pipes;
    ``cleanups``: LaunchSpec.cleanups, run once every process ended or the kernel died."""

    job_id: str
    cwd: str
    job_dir: str  # the kernel removes it; the start process does if the kernel died first
    processes: tuple[ProcessSpec, ...]
    shared: int = 0
    cleanups: tuple = ()

    def valid(self) -> bool:
        return (isinstance(self.job_id, str) and isinstance(self.cwd, str)
                and isinstance(self.job_dir, str) and isinstance(self.processes, tuple)
                and all(isinstance(p, ProcessSpec) for p in self.processes)
                and isinstance(self.shared, int) and 0 <= self.shared <= MAX_SHARED_FDS
                and isinstance(self.cleanups, tuple)
                and all(isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str)
                        for c in self.cleanups))

    @property
    def fds(self) -> int:
        """How many fds follow this message on the socket."""
        return len(STREAMS) * len(self.processes) + self.shared


@dataclass(frozen=True)
class Spawned:
    job_id: str
    pids: dict[str, int]

    def valid(self) -> bool:
        return isinstance(self.job_id, str) and _is_str_dict(self.pids, int)


@dataclass(frozen=True)
class SpawnError:
    job_id: str
    message: str  # one line, for the user
    replace: bool = False  # the start process is exiting: the kernel starts a fresh one

    def valid(self) -> bool:
        return isinstance(self.job_id, str) and isinstance(self.message, str) and isinstance(self.replace, bool)


@dataclass(frozen=True)
class Exited:
    job_id: str
    key: str
    pid: int
    returncode: int  # negative: killed by signal -returncode

    def valid(self) -> bool:
        return (isinstance(self.job_id, str) and isinstance(self.key, str)
                and isinstance(self.pid, int) and isinstance(self.returncode, int))


@dataclass(frozen=True)
class Stop:
    """SIGTERM every process of the job, SIGKILL after ``grace`` seconds."""

    job_id: str
    grace: float

    def valid(self) -> bool:
        return isinstance(self.job_id, str) and isinstance(self.grace, (int, float))


@dataclass(frozen=True)
class Stopped:
    job_id: str

    def valid(self) -> bool:
        return isinstance(self.job_id, str)


@dataclass(frozen=True)
class Become:
    """To a child forked ahead: become this process (its pipes come with the message)."""

    spec: ProcessSpec
    cwd: str

    def valid(self) -> bool:
        return isinstance(self.spec, ProcessSpec) and isinstance(self.cwd, str)


Message = Ready | Spawn | Spawned | SpawnError | Exited | Stop | Stopped | Become
MESSAGES: tuple[type, ...] = (Ready, Spawn, Spawned, SpawnError, Exited, Stop, Stopped, Become)


def decode(data: bytes) -> Message | None:
    """The message in ``data``, or None (logged) when it is not one we can read."""
    try:
        message = pickle.loads(data)
    except Exception as exc:  # any unpickling error: a garbled or foreign message, never fatal
        log.warning("taas: ignored an unreadable message on the start-process channel (%s)",
                    type(exc).__name__)
        return None
    if type(message) not in MESSAGES or not message.valid():
        log.warning("taas: ignored a malformed message on the start-process channel: %.200r",
                    message)
        return None
    return message


def encode(message: Message) -> bytes:
    return pickle.dumps(message)


def send(conn: Connection, message: Message) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Message | None:
    """One message from ``conn``, None if it was unreadable; EOFError/OSError when the other
    end is gone.  A whole frame is read before it is decoded, so a bad one never leaves the
    channel out of step."""
    return decode(conn.recv_bytes())


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    """Pass ``fds`` in batches of FDS_PER_MESSAGE, one marker byte each."""
    for start in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"f"], fds[start : start + FDS_PER_MESSAGE])


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """``count`` fds sent by :func:`send_fds`."""
    fds: list[int] = []
    while len(fds) < count:
        data, batch, _, _ = socket.recv_fds(sock, 1, min(FDS_PER_MESSAGE, count - len(fds)))
        if not data:
            for fd in fds + list(batch):
                os.close(fd)
            raise EOFError("the kernel closed the channel")
        fds.extend(batch)
    return fds


def ready_message_max(channel: socket.socket) -> int:
    """The largest Become a ready child can receive: one datagram (the socket's send buffer
    less its overhead), and no more than the child reads."""
    return min(channel.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32, READY_MESSAGE_MAX)
