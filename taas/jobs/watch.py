"""Wake a viewer when a job's record folder changes, instead of looking at a fixed period.

A viewer (``%taas attach``, ``taas logs -f``) waits for the job's next line or its end.  Polling
costs the period's half on average at every step, and CPU while the job is silent; Linux's
inotify tells at once.  :class:`Changes` watches the folder (record.json replaced, results.pkl
written) and its logs (``out/``, ``metrics/``: appended); ``wait(timeout)`` returns at the first
change, or after ``timeout`` (a viewer still looks then: a change inotify cannot see, such as a
lock freed by a dead host, is found by looking).  Where inotify is unavailable (no watches left)
it is a plain sleep of ``fallback`` seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import time

from taas.jobs import api
from taas.ready import wait_readable

_IN_MODIFY, _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x8, 0x80, 0x100
_IN_DELETE_SELF, _IN_ONLYDIR = 0x400, 0x01000000
_MASK = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE_SELF
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC

_libc = None


def _inotify():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


class Changes:
    """The changes of the record folder ``folder`` and its logs, as a wait."""

    def __init__(self, folder: pathlib.Path | None, fallback: float = 0.02):
        """``folder`` None: records that are not files here (a cluster's): looks every ``fallback`` s."""
        self.folder = pathlib.Path(folder) if folder is not None else None
        self.fallback = fallback  # without inotify: how often to look
        self._fd = -1
        self._watched: set[str] = set()
        if self.folder is None:
            return
        try:
            self._fd = _inotify().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError):
            self._fd = -1
        if self._fd >= 0:
            self._watch_all()

    def _watch_all(self) -> None:
        assert self.folder is not None
        for path in (self.folder, self.folder / api.OUT, self.folder / api.METRICS):
            if str(path) in self._watched or not path.is_dir():
                continue
            if _inotify().inotify_add_watch(self._fd, os.fsencode(path), _MASK | _IN_ONLYDIR) >= 0:
                self._watched.add(str(path))

    def wait(self, timeout: float) -> bool:
        """Until something changed (True) or ``timeout`` s passed (False)."""
        if self._fd < 0:
            time.sleep(min(timeout, self.fallback))
            return False
        if not wait_readable(self._fd, timeout):
            return False
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass
        except OSError:
            return True
        if len(self._watched) < 3:  # a log folder made since: watch it too
            self._watch_all()
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
