"""The events pipe: structured messages from a process to the kernel, one JSON object a line.

Besides stdout and stderr every process has a third pipe (fd in ``TAAS_EVENTS_FD``).  Rank 0
sends display data on it; loader workers and rank views send data-plane figures.  JSON keeps
the kernel from ever unpickling what user code produced.
"""

from __future__ import annotations

import json
import os
import threading

_lock = threading.Lock()


def send(kind: str, **fields) -> None:
    send_many((kind, fields))


def send_many(*messages: tuple[str, dict]) -> None:
    """Several messages, in order, in one write: the kernel wakes once for them all (a kept
    rank's ``comm`` and ``done`` at the end of each cell)."""
    fd = os.environ.get("TAAS_EVENTS_FD")
    if fd is None or not messages:
        return
    data = b"".join((json.dumps({"kind": kind, **fields}) + "\n").encode() for kind, fields in messages)
    with _lock:
        view = memoryview(data)
        while view:
            view = view[os.write(int(fd), view):]
