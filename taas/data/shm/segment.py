"""A loader's header segment: the shared state of its loader workers and channels.

Per loader per job, ``/dev/shm/taas-<job>-<loader>`` (created by the kernel, mode 0600), in u64
words::

    0           global    magic, version, workers, channels, bound, failed worker + 1 and
                          its failure's length (the kernel's, on kept ranks), from byte 64
                          the failure's text (UTF-8)
    512         workers   64 bytes each: produced, state, unit, since (f64), prefetched
    ...         channels  128 bytes each: producer line (sent msgs, sent bytes, units, waiting),
                          consumer line (taken msgs, taken bytes, pid, closed, wanted unit + 1,
                          since (f64)), each side writing only its own line

The names of one job attempt's segments follow one grammar, matched whole, never by prefix:
``taas-<attempt>-<loader>`` (a header) and ``taas-<attempt>-<loader>-c<channel>-b<block>`` (the
blocks :mod:`taas.data.shm.ring` creates).  :func:`unlink_job` removes exactly those; the
transport (:mod:`taas.data.shm.transport`) calls it when the attempt ends, and its cleanup hook
when the kernel died.  A prefix would not do: the next attempt of job J is ``J-1``
(:func:`taas.launch.api.attempt_id`), so ``taas-J-`` also starts every name of attempt ``J-1``
-- and the start process runs attempt J's hook late, once J's processes ended, when attempt
``J-1`` may have made its segments already -- as well as the job's big values
(``taas-J-value0``, :mod:`taas.job.memory.bigvalues`).  Also here: the channel FIFOs (made by
the kernel in the transport's private directory) and the small helpers both channel ends use.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from dataclasses import dataclass

import _posixshmem

MAGIC = 0x7461617364617461
VERSION = 2
GLOBAL_BYTES, WORKER_BYTES, CHANNEL_BYTES = 512, 64, 128
# worker words (W_STATE: taas.data.transport.STARTING ... DONE)
W_PRODUCED, W_STATE, W_UNIT, W_SINCE, W_PREFETCHED = range(5)
# global words after the five of the layout: a failed worker (+ 1, 0: none), its text's length
G_FAILED, G_FAILURE_LEN = 5, 6
FAILURE_AT = 64  # bytes: where the failure's text starts in the global area (up to GLOBAL_BYTES)
# channel words: producer line, consumer line (its own cache line)
C_SENT_MSGS, C_SENT_BYTES, C_UNITS, C_WAITING = 0, 1, 2, 3
C_TAKEN_MSGS, C_TAKEN_BYTES, C_PID, C_CLOSED, C_WANT, C_WANT_SINCE = 8, 9, 10, 11, 12, 13
SHM_PREFIX = "taas-"


def segment_name(job_id: str, index: int) -> str:
    return f"{SHM_PREFIX}{job_id}-{index}"


def block_name(header: str, channel: int, block: int) -> str:
    """A block of ``header``'s channel ``channel`` (:data:`BLOCK_SUFFIX` matches it)."""
    return f"{header}-c{channel}-b{block}"


@dataclass(frozen=True)
class Layout:
    workers: int
    channels: int
    bound: int  # bytes in flight per channel

    @property
    def channels_offset(self) -> int:
        return GLOBAL_BYTES + self.workers * WORKER_BYTES

    @property
    def size(self) -> int:
        return self.channels_offset + self.channels * CHANNEL_BYTES


def _shm_create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:  # Ctrl-C included: never leave a half-made segment; re-raised
        unlink(name)
        raise
    finally:
        os.close(fd)


def _shm_attach(name: str) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


BLOCK_SUFFIX = r"(?:-c[0-9]+-b[0-9]+)?"  # a header's blocks: <header>-c<channel>-b<block>


def names_of(job_id: str, middle: str = "") -> "re.Pattern[str]":
    """The whole names of job attempt ``job_id``'s headers ``taas-<job><middle><loader>`` and
    their blocks (``middle``: a regular expression, e.g. a relay's ``-n<node>``): a full match,
    so that no other attempt's name (``taas-<job>-1-0``) nor another room's (``taas-<job>-value0``)
    is one of them."""
    return re.compile(re.escape(f"{SHM_PREFIX}{job_id}") + middle + "-[0-9]+" + BLOCK_SUFFIX)


def unlink_matching(pattern: "re.Pattern[str]") -> list[str]:
    """Unlink every segment whose whole name matches ``pattern``; returns the names."""
    try:
        names = [n for n in os.listdir("/dev/shm") if pattern.fullmatch(n)]
    except OSError:
        return []
    for name in names:
        unlink(name)
    return names


def unlink_job(job_id: str) -> list[str]:
    """Unlink every segment of job attempt ``job_id`` (its headers and all their blocks), and
    nothing else; returns the names."""
    return unlink_matching(names_of(job_id))


class Segment:
    """A loader's header segment, mapped.  ``q``/``d`` see its words as u64 / f64."""

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout):
        self.name, self.mm, self.layout = name, mm, layout
        self.q = memoryview(mm).cast("Q")
        self.d = memoryview(mm).cast("d")

    @classmethod
    def create(cls, name: str, layout: Layout) -> "Segment":
        seg = cls(name, _shm_create(name, layout.size), layout)
        for i, v in enumerate((MAGIC, VERSION, layout.workers, layout.channels, layout.bound)):
            seg.q[i] = v
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        mm = _shm_attach(name)
        magic, version, workers, channels, bound = struct.unpack_from("<5Q", mm, 0)
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise RuntimeError(f"shared-memory segment {name} is not a taas data segment")
        return cls(name, mm, Layout(workers, channels, bound))

    def _w(self, worker: int, word: int) -> int:
        return (GLOBAL_BYTES + worker * WORKER_BYTES) // 8 + word

    def _c(self, channel: int, word: int) -> int:
        return (self.layout.channels_offset + channel * CHANNEL_BYTES) // 8 + word

    def worker(self, worker: int, word: int) -> int:
        return self.q[self._w(worker, word)]

    def set_worker(self, worker: int, word: int, value: int) -> None:
        self.q[self._w(worker, word)] = value

    def worker_since(self, worker: int) -> float:
        return self.d[self._w(worker, W_SINCE)]

    def set_worker_state(self, worker: int, state: int, unit: int = 0, since: float | None = None) -> None:
        """``since``: when it entered ``state`` (monotonic; default now)."""
        self.d[self._w(worker, W_SINCE)] = time.monotonic() if since is None else since
        self.q[self._w(worker, W_UNIT)] = unit
        self.q[self._w(worker, W_STATE)] = state

    def channel(self, channel: int, word: int) -> int:
        return self.q[self._c(channel, word)]

    def set_channel(self, channel: int, word: int, value: int) -> None:
        self.q[self._c(channel, word)] = value

    def want_since(self, channel: int) -> float:
        return self.d[self._c(channel, C_WANT_SINCE)]

    def set_want(self, channel: int, unit: int | None) -> None:
        if unit is None:
            self.q[self._c(channel, C_WANT)] = 0
        else:
            self.d[self._c(channel, C_WANT_SINCE)] = time.monotonic()
            self.q[self._c(channel, C_WANT)] = unit + 1

    def set_failure(self, worker: int, text: str) -> None:
        """Loader worker ``worker`` failed (the kernel says so, for kept ranks' views): its
        text first, then the flag, which readers check."""
        data = text.encode()[:GLOBAL_BYTES - FAILURE_AT]
        self.mm[FAILURE_AT:FAILURE_AT + len(data)] = data
        self.q[G_FAILURE_LEN] = len(data)
        self.q[G_FAILED] = worker + 1

    def failure(self) -> tuple[int, str] | None:
        """(worker, text) of this loader's failure, or None."""
        failed = self.q[G_FAILED]
        if not failed:
            return None
        size = min(self.q[G_FAILURE_LEN], GLOBAL_BYTES - FAILURE_AT)
        return failed - 1, bytes(self.mm[FAILURE_AT:FAILURE_AT + size]).decode(errors="replace")

    def close(self) -> None:
        self.q.release()
        self.d.release()
        self.mm.close()


def fifo_paths(directory: str, loader: int, channel: int) -> tuple[str, str]:
    """A channel's two FIFOs: ``data`` (producer -> consumer), ``space`` (back)."""
    return (os.path.join(directory, f"data-{loader}-{channel}.fifo"),
            os.path.join(directory, f"space-{loader}-{channel}.fifo"))


def make_fifos(directory: str, loader: int, channel: int) -> tuple[str, str]:
    paths = fifo_paths(directory, loader, channel)
    for path in paths:
        os.mkfifo(path, 0o600)
    return paths


def _open_fifo(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)  # never blocks on open, never sees EOF


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
