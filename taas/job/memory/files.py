"""Shared-memory files for big values: written in parallel, unnamed until published.

The file side of :mod:`taas.job.memory.bigvalues` (which decides what goes where): an unnamed
file (``O_TMPFILE``) in a directory, named once the payload that refers to it is complete, so a
kernel killed meanwhile leaves nothing; where a directory cannot do that, a named file.
"""

from __future__ import annotations

import ctypes
import os

from taas.job.memory import resident

_CHUNK = 1 << 28  # one write() call at most (Linux caps a write near 2 GiB)
WRITERS = 8  # threads writing one big value (no more than the CPUs)
_PART = 32 << 20  # a thread writes at least this much


def write_parallel(fd: int, data: memoryview) -> None:
    """``data`` into ``fd``, in contiguous parts written by up to WRITERS threads at once:
    getting new pages is most of the cost, and it parallelises (a 1 GiB write took 1.7-3.2 s
    in one thread and 0.6-0.7 s in two, on a 2-core VM whose host reclaims freed memory)."""
    nbytes = data.nbytes
    parts = max(1, min(WRITERS, os.cpu_count() or 1, nbytes // _PART))
    bounds = [nbytes * i // parts for i in range(parts + 1)]

    def write(start: int, end: int) -> None:
        while start < end:
            start += os.pwrite(fd, data[start:min(end, start + _CHUNK)], start)

    resident.in_parts(write, bounds, "taas-write")


UNNAMED_OK: dict[str, bool] = {}  # directory -> unnamed files can be named there later


def create(directory: str, path: str) -> tuple[int, bool]:
    """An unnamed file in ``directory`` (O_TMPFILE), or where one cannot be named later (the
    file system, or the process's rights), the file ``path`` itself: (fd, named)."""
    if UNNAMED_OK.get(directory) is None:
        UNNAMED_OK[directory] = probe_unnamed(directory)
    if UNNAMED_OK[directory]:
        return open_unnamed(directory), False
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), True


def open_unnamed(directory: str, mode: int = os.O_WRONLY) -> int:
    return os.open(directory, os.O_TMPFILE | mode | os.O_CLOEXEC, 0o600)


def probe_unnamed(directory: str) -> bool:
    probe = os.path.join(directory, f"taas-probe-{os.getpid()}")
    try:
        fd = open_unnamed(directory)
    except (OSError, AttributeError):
        return False
    try:
        link(fd, probe)
    except OSError:
        return False
    finally:
        os.close(fd)
    remove(probe)
    return True


def link(fd: int, path: str) -> None:
    """Name the unnamed file ``fd``: linkat(AT_EMPTY_PATH), else through /proc/self/fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) == 0:
        return
    os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)


_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
