"""``taas.log`` in a rank: rows buffered here, sent to the kernel as "metrics" events.

A ``taas.log`` call must cost a training loop microseconds, not a write to a pipe: it checks
its values (:func:`taas.job.metrics.check`) and appends one row to a deque.  A daemon thread,
started by the first row, sends what piled up at most every :data:`INTERVAL` seconds, as
event lines of at most ``ROWS_PER_EVENT`` rows; :func:`flush` sends the rest at the cell's end,
before the rank says "done" (so the kernel has every row when the job ends).  The buffer is
bounded: a rank that logs faster than the thread sends (``CAPACITY`` rows waiting) sends them
itself, so memory stays bounded and no row is lost.  A value that is not a finite number is
left out with one note per name, on this rank's stderr; the job goes on.

Hugging Face's and Lightning's own logs come here too (:mod:`taas.rank.trainers`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque

from taas.job import metrics as rows_format
from taas.launch.process import events

INTERVAL = 0.2  # seconds between two sends of the background thread
CAPACITY = 10_000  # rows waiting before the logging thread sends them itself


class Buffer:
    """One rank's rows on their way to the kernel (see the module docstring).

    The rows wait in a deque: the logging thread appends, the sender pops from the other end,
    both safe without a lock, so a ``taas.log`` call takes no lock on its way."""

    def __init__(self, send=events.send, interval: float = INTERVAL, capacity: int = CAPACITY,
                 write_note=None) -> None:
        self._send = send
        self.interval = interval
        self.capacity = capacity
        self._rows: deque = deque()
        self._send_lock = threading.Lock()  # one send at a time keeps each rank's rows in order
        self._pending = threading.Event()  # rows are waiting: the thread sends them soon
        self._thread: threading.Thread | None = None
        self.last_step = -1
        self.notes = rows_format.Notes(write_note or _note)

    def log(self, step, scalars: dict) -> None:
        """Record ``scalars`` (a dict this buffer may keep) at ``step`` (None: the next)."""
        fast = step is None or type(step) is int
        if fast:  # the common case, checked inline: an int step and finite floats
            for value in scalars.values():
                if type(value) is not float or value - value != 0.0:  # (NaN and inf: not 0.0)
                    fast = False
                    break
        if fast:
            if step is None:
                step = self.last_step + 1
            if not scalars:
                return
        else:
            row = rows_format.check(step, scalars, self.last_step, self.notes)
            if row is None:
                return
            step, scalars = row
        self.last_step = step
        rows = self._rows
        rows.append((step, scalars))
        if not self._pending.is_set():
            if self._thread is None:
                self._start()
            self._pending.set()
        if len(rows) >= self.capacity:
            self.flush()  # the thread falls behind: this caller pays, memory stays bounded

    def flush(self) -> None:
        """Send every row logged so far (the thread's way, and the cell's end)."""
        with self._send_lock:
            rows, taken = self._rows, []
            while rows:
                taken.append(rows.popleft())
            for start in range(0, len(taken), rows_format.ROWS_PER_EVENT):
                chunk = taken[start:start + rows_format.ROWS_PER_EVENT]
                self._send(rows_format.KIND, rows=[[step, values] for step, values in chunk])

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="taas-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            time.sleep(self.interval)  # rows logged meanwhile go in the same event
            self._pending.clear()  # before taking the rows: one logged after this wakes us again
            try:
                self.flush()
            except (OSError, ValueError, TypeError) as exc:  # the kernel is gone, or a value JSON refuses
                print(f"taas: metrics could not be sent ({type(exc).__name__}: {exc})", file=sys.stderr)
                return


def _note(line: str) -> None:
    print(line, file=sys.stderr)


_buffer: Buffer | None = None


def install() -> Buffer:
    """Make ``taas.log`` record into this rank's buffer (called before the cell runs), and
    Hugging Face's and Lightning's Trainers log there too."""
    global _buffer
    from taas.rank import trainers

    _buffer = Buffer()
    rows_format.set_recorder(_buffer.log)
    trainers.install(_buffer.log)
    os.register_at_fork(after_in_child=_forked)
    return _buffer


def flush() -> None:
    """Send what is buffered (the cell's end: before "done").  Never raises: metrics only inform."""
    if _buffer is None:
        return
    try:
        _buffer.flush()
    except (OSError, ValueError, TypeError) as exc:
        print(f"taas: metrics could not be sent ({type(exc).__name__}: {exc})", file=sys.stderr)


def new_cell() -> None:
    """A kept rank's next cell: its ``taas.log`` steps count from 0 again and its notes show
    again, as in a job of its own."""
    if _buffer is not None:
        _buffer.last_step = -1
        _buffer.notes.seen.clear()


def _forked() -> None:
    """A process this rank forked (a DataLoader worker) has no sender thread and shares the
    events pipe: its ``taas.log`` calls record nothing, rather than hang or interleave."""
    rows_format.set_recorder(lambda step, scalars: None)

