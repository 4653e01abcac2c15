"""Where is a rank now?  Its main thread's Python stack, on the kernel's request.

The kernel asks when a job runs past ``--timeout``, when the user interrupts it and when no
rank printed anything for ``--stall`` seconds (see :mod:`taas.io.hang` for what it does with
the answers).  A hung rank's main thread is usually blocked inside a C collective
(``all_reduce`` waiting for a peer): a Python signal handler would only run once that call
returns, i.e. never.  So each rank starts a daemon thread (:func:`start`) that blocks reading
a FIFO of its own, ``<job_dir>/stacks/<key>``; the kernel writes one byte to it
(:func:`request`).  The thread then reads the main thread's frame with
``sys._current_frames()`` -- the collective released the GIL, so the thread runs -- and sends
it on the events pipe as one ``{"kind": "stack", ...}`` line:

    frames  the stack, outermost first, from the cell's first frame; taas's own frames dropped
    line    the innermost line of the cell itself (None: the rank is not in the cell)
    call    that line's source text
    debugger  true when the rank is in the debugger (pdb's frames are on its stack)

Nothing here stops or slows the rank: the thread sleeps in ``open``/``read`` until asked.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading

from taas.launch.process import events
from taas.launch.process.report import _internal


def fifo_path(job_dir: str, key: str) -> str:
    return os.path.join(job_dir, "stacks", key)


# ---- rank side -----------------------------------------------------------------------------
def start(job_dir: str, key: str, filename: str) -> None:
    """Answer the kernel's stack requests from now on (call it from the rank's main thread)."""
    path = fifo_path(job_dir, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path, 0o600)
    except OSError:
        return  # no FIFO, no answers: the kernel reports "no answer" for this rank
    main = threading.get_ident()
    threading.Thread(target=_serve, args=(path, main, filename), name="taas-stacks",
                     daemon=True).start()


_cell_file: list[str] = []  # a kept rank's current cell (set_cell); empty: the one given to start()


def set_cell(filename: str) -> None:
    """A kept rank runs another cell: answers name lines of ``filename`` from now on."""
    _cell_file[:] = [filename]


def _serve(path: str, main: int, filename: str) -> None:
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)  # blocks until the kernel opens it to write
        except OSError:
            return  # the job directory is gone: the job is over
        try:
            while True:
                data = os.read(fd, 64)
                if not data:
                    break  # the kernel closed its end; wait for the next request
                events.send("stack", **snapshot(main, _cell_file[0] if _cell_file else filename))
        except OSError:
            return
        finally:
            os.close(fd)


def snapshot(thread_id: int, filename: str) -> dict:
    """The stack of thread ``thread_id`` and its innermost line in ``filename`` (the cell)."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append({"filename": code.co_filename, "lineno": frame.f_lineno, "name": code.co_name,
                       "line": linecache.getline(code.co_filename, frame.f_lineno or 0).strip()})
        frame = frame.f_back
    frames.reverse()
    # At a prompt of the debugger (taas.rank.console's pdb): the hang doctor never counts it.
    debugger = any(f["filename"].endswith(os.sep + "bdb.py") for f in frames)
    frames = [f for f in frames if not _internal(f["filename"])]
    in_cell = [i for i, f in enumerate(frames) if f["filename"] == filename]
    if in_cell:
        frames = frames[in_cell[0]:]  # what ran the cell (runpy...) is no news to the user
    here = frames[in_cell[-1] - in_cell[0]] if in_cell else None
    return {"frames": frames, "line": here["lineno"] if here else None,
            "call": here["line"] if here else "", "debugger": debugger}


# ---- kernel side ---------------------------------------------------------------------------
def request(job_dir: str, keys) -> list[str]:
    """Ask each process in ``keys`` for its stack; the keys that were asked (a process that
    has not started its thread yet, or already ended, cannot be)."""
    asked = []
    for key in keys:
        try:
            fd = os.open(fifo_path(job_dir, key), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody reads it (yet, or any more); ENOENT: never made
            continue
        try:
            os.write(fd, b"?")
            asked.append(key)
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked
