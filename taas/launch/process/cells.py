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
        if not os.path.exists(path):
            os.mkfifo(path, 0o600)
        self.fd = os.open(path, os.O_RDWR)  # never blocks, never sees EOF
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
    fd = os.open(fifo_path(job_dir, key), os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, encode(message))
    finally:
        os.close(fd)
