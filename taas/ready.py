"""Waiting until descriptors are ready: the one poll(2) every room that waits on a descriptor
uses (the job host's socket, the shared-memory ring's wake pipes, the TCP transport's sockets,
the results channel, the job-log watcher, the Ray node agent).

Never select(2): it refuses a descriptor numbered 1024 or more, and a kernel with many files
open (taas raises its limit), a rank of a large job (a socket per peer) or a job host hold
such numbers.  A file here is a descriptor number or anything with ``fileno()``.  Timeouts are
seconds (None: until one is ready; 0: only look), rounded up to poll's milliseconds, so a short
wait never becomes a busy loop.

Imports nothing of taas: any room may use it.
"""

from __future__ import annotations

import select
from collections.abc import Iterable, Sequence
from typing import Any

IN, OUT, CLOSED = select.POLLIN, select.POLLOUT, select.POLLNVAL  # CLOSED: the fd was not open


def poll(interest: Iterable[tuple[Any, int]], timeout: float | None) -> dict[int, int]:
    """Wait until one of the ``(file, events)`` pairs is ready, at most ``timeout`` s:
    descriptor -> the events that happened (a hang-up or an error counts too), for those ready."""
    poller = select.poll()
    for file, events in interest:
        poller.register(file, events)
    return dict(poller.poll(None if timeout is None else max(0.0, timeout) * 1000))


def readable(files: Sequence[Any], timeout: float | None = None) -> list:
    """Those of ``files`` that can be read now (a closed peer reads as its end), in their order,
    waiting up to ``timeout`` s for one."""
    events = poll(((file, IN) for file in files), timeout)
    return [file for file in files if _number(file) in events]


def wait_readable(file: Any, timeout: float | None) -> int:
    """Until ``file`` can be read, at most ``timeout`` s: its events (0: the time ran out)."""
    return poll(((file, IN),), timeout).get(_number(file), 0)


def _number(file: Any) -> int:
    return file if isinstance(file, int) else file.fileno()
