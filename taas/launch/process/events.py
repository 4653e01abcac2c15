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
    fd = os.environ.get("TAAS_EVENTS_FD")
    if fd is None:
        return
    line = (json.dumps({"kind": kind, **fields}) + "\n").encode()
    with _lock:
        view = memoryview(line)
        while view:
            view = view[os.write(int(fd), view):]
