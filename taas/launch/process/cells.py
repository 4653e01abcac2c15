"""Kept ranks' cell channel: how the kernel tells a rank that lives between cells what to do next.

A kept rank (``--keep``) does not exit after its cell: it waits on a FIFO of its own in its job
directory (``cells/<key>``) for one line, a :class:`NextCell` (run the payload file it names,
which the launcher has put in the job directory) or a :class:`Release` (leave).  The rank opens
its FIFO read-write, so it never blocks on an absent writer and a line the kernel writes
before the rank reads is not lost; a line is one ``write`` under ``PIPE_BUF``, so it arrives
whole.  The kernel side (:func:`send`) opens it non-blocking: a rank that is gone is an error
at once, not a hang.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from taas.launch.api import process_stat

FIFO_DIR = "cells"


@dataclass(frozen=True)
class NextCell:
    """Run the cell whose payload is ``payload`` (a file name in the job directory)."""

    payload: str
    result: str  # where rank 0 writes this cell's results (a file name in the job directory)


@dataclass(frozen=True)
class Release:
    """Leave: the kept ranks are released."""


Message = NextCell | Release


def fifo_path(job_dir: str, key: str) -> str:
    return os.path.join(job_dir, FIFO_DIR, key)


def encode(message: Message) -> bytes:
    if isinstance(message, NextCell):
        return (json.dumps({"kind": "cell", "payload": message.payload, "result": message.result})
                + "\n").encode()
    return b'{"kind": "release"}\n'


def decode(line: bytes) -> Message | None:
    """The message on ``line``, or None when it is not one (ignored, never fatal)."""
    try:
        m = json.loads(line)
    except ValueError:
        return None
    if not isinstance(m, dict):
        return None
    if m.get("kind") == "release":
        return Release()
    if m.get("kind") == "cell" and isinstance(m.get("payload"), str) and isinstance(m.get("result"), str):
        if "/" in m["payload"] or "/" in m["result"]:
            return None  # names in the job directory only
        return NextCell(m["payload"], m["result"])
    return None


# ---- rank side -----------------------------------------------------------------------------
class Inbox:
    """The rank's end of its FIFO (created here, before the rank says it is up)."""

    def __init__(self, job_dir: str, key: str):
        path = fifo_path(job_dir, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            self.fd = os.open(path, os.O_RDWR)  # never blocks, never sees EOF
        else:  # made under another name and opened first: where it is seen, it has its reader
            fresh = f"{path}.{os.getpid()}"
            os.mkfifo(fresh, 0o600)
            self.fd = os.open(fresh, os.O_RDWR)
            os.replace(fresh, path)
        self._buffer = b""

    def next(self) -> Message:
        """Block until the next message."""
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = decode(line)
                if message is not None:
                    return message
            data = os.read(self.fd, 4096)
            self._buffer += data


# ---- kernel side -----------------------------------------------------------------------------
def send(job_dir: str, key: str, message: Message) -> None:
    """Write ``message`` to rank ``key``'s FIFO; OSError when the rank is not there."""
    send_all(job_dir, [key], message)


def send_all(job_dir: str, keys, message: Message) -> None:
    """Write ``message`` to every rank's FIFO in ``keys``, or to none: each FIFO is opened
    first, and one with no reader (its rank is gone, though its exit may not be reported yet)
    raises OSError before anything is written, its ``filename`` the rank's key."""
    fds = open_all(job_dir, keys)
    try:
        write_all(fds, message)
    finally:
        close_all(fds)


def open_all(job_dir: str, keys) -> list[int]:
    """Every rank's FIFO in ``keys``, opened to write (nothing written yet), or OSError for the
    first with no reader (its ``filename`` the rank's key; none left open): the caller may do
    more before it sends (:func:`write_all`), then closes them (:func:`close_all`)."""
    fds: list[int] = []
    try:
        _open_all(job_dir, keys, fds)
    except BaseException:
        close_all(fds)
        raise
    return fds


def write_all(fds: list[int], message: Message) -> None:
    data = encode(message)
    for fd in fds:
        os.write(fd, data)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def unreachable(job_dir: str, keys) -> OSError | None:
    """Why a rank in ``keys`` cannot be sent a cell now (its FIFO has no reader: the rank
    process is gone, whether or not its exit has been reported), or None."""
    fds: list[int] = []
    try:
        _open_all(job_dir, keys, fds)
    except OSError as exc:
        return exc
    finally:
        for fd in fds:
            os.close(fd)
    return None


def ending(pids: dict[str, int]) -> str | None:
    """The first of ``pids`` (key -> pid of a kept rank) whose process is ending or gone, as
    ``"KEY ended"``; None when every one lives.  A SIGKILLed rank's main thread ends first (the
    process shows as a zombie) while its other threads still hold its files, its FIFO among
    them, for a moment: :func:`unreachable` cannot see it yet, this can."""
    for key, pid in pids.items():
        if _state(pid) not in (None, "Z", "X"):
            continue
        return f"{key} ended"
    return None


def _state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``Z``: a zombie, ...), or None if it is gone:
    one read of ``/proc/PID/stat`` (a kept cell asks it of every rank, so no psutil object)."""
    fields = process_stat(pid)
    return fields[0].decode() if fields else None


def _open_all(job_dir: str, keys, fds: list[int]) -> None:
    # A kept rank holds its FIFO open for reading as long as it lives: opening it to write,
    # non-blocking, fails (ENXIO) once the rank is gone.
    for key in keys:
        try:
            fds.append(os.open(fifo_path(job_dir, key), os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            exc.filename = key
            raise
