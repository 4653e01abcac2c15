"""A job's wait for its GPUs: in line, one line updated in place, until it holds them all.

    acquire(count, holder, inventory, show, note, no_wait) -> Lease

First one look as if last in line: with no one waiting and enough GPUs free, the job takes
them at once.  Otherwise it takes a place in line (:class:`taas.leases.locks.Place`), then,
until it holds its GPUs: reads the GPUs (``inventory``: real or fake), the leases held and the live line, asks
:func:`taas.leases.decide.decide`, and either takes the GPUs (all or none) or shows the wait
line and looks again a moment later.  An interrupt (KeyboardInterrupt) leaves the line and
lets go of anything taken: nothing starts.  ``no_wait``: the first "not now" is a one-line
LaunchError instead.  The line is never waited on for a holder that is gone: its lock went
with it, and the next look sees the GPU free.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import time
from collections.abc import Callable, Sequence

from taas.errors import LaunchError
from taas.leases import locks
from taas.leases.api import Gpu, Holder, Take
from taas.leases.decide import busy_note, busy_outside, decide, gpu_lines, refusal, wait_line

POLL = 0.5  # seconds between looks while waiting
AFTER_ALL = "~"  # sorts after every ticket name: a request not in line (--no-wait)


def holder_for(job: str, environ=os.environ) -> Holder:
    """This process as a holder of job ``job``: user, now, the notebook when Jupyter says."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.geteuid())
    notebook = os.path.basename(environ.get("JPY_SESSION_NAME", ""))
    return Holder(job, user, time.time(), notebook, os.getpid())


def acquire(count: int, holder: Holder, inventory: Callable[[], Sequence[Gpu]],
            show: Callable[[str, bool], None], note: Callable[[str], None], *,
            no_wait: bool = False, busy_mib: int = 1024, path: str | None = None,
            pause: Callable[[float], None] = time.sleep) -> locks.Lease:
    """Lease ``count`` GPUs of ``inventory()`` for ``holder``, waiting in line unless
    ``no_wait``.  ``show(text, final)``: the wait line, in place; ``note(line)``: said once."""
    path = path or locks.lock_dir()
    try:
        return _acquire(count, holder, inventory, show, note, no_wait, busy_mib, path, pause)
    except OSError as exc:  # the lock directory: not shared, not writable, gone
        raise LaunchError(f"cannot use the GPU lease directory {path} ({exc.strerror or exc}); "
                          f"set {locks.ENV} to a directory every user of this machine can write") from None


def _acquire(count: int, holder: Holder, inventory: Callable[[], Sequence[Gpu]],
             show: Callable[[str, bool], None], note: Callable[[str], None], no_wait: bool,
             busy_mib: int, path: str, pause: Callable[[float], None]) -> locks.Lease:
    locks.ensure(path)
    said: set[str] = set()

    def offered() -> Sequence[Gpu]:  # never a wait for GPUs this machine does not offer
        gpus = inventory()
        if count > len(gpus):
            raise LaunchError(f"--gpus {count} asks for more GPUs than taas may use here ({len(gpus)}"
                              + (f", CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
                                 if "CUDA_VISIBLE_DEVICES" in os.environ else "") + "); nothing was started")
        return gpus

    def say_busy(gpus: Sequence[Gpu]) -> None:
        fresh = [g for g in gpus if g.uuid not in said]
        if fresh:
            said.update(g.uuid for g in fresh)
            note(busy_note(fresh))

    # First one look, as if last in line: with no one waiting and enough free GPUs, the job
    # takes them without a place in line (the common case: a few file operations).
    gpus = offered()
    held = locks.held(path)
    decision = decide(gpus, held, locks.line(path), AFTER_ALL, count, busy_mib)
    if isinstance(decision, Take):
        lease = locks.try_take(path, decision.uuids, dataclasses.replace(holder, since=time.time()))
        if lease is not None:
            say_busy([g for g in gpus if busy_outside(g, held, busy_mib)])
            return lease
        if no_wait:  # taken by someone else between the look and the take
            raise LaunchError(f"--no-wait: {count} GPU(s) asked, another job took them at the "
                              "same moment; nothing was started")
    elif no_wait:
        raise LaunchError(refusal(count, decision))
    started = time.monotonic()
    waited = False
    shown = ""
    place = locks.Place(path, count, holder)
    try:
        while True:
            gpus = offered()
            held = locks.held(path)
            decision = decide(gpus, held, locks.line(path), place.name, count, busy_mib)
            if isinstance(decision, Take):
                # The lease's record says since when it holds them, not since when it waited.
                lease = locks.try_take(path, decision.uuids, dataclasses.replace(holder, since=time.time()))
                if lease is not None:
                    say_busy([g for g in gpus if busy_outside(g, held, busy_mib)])
                    if waited:
                        show(f"taas: waited {time.monotonic() - started:.0f} s for {count} GPU(s)", True)
                    return lease
            else:
                say_busy(decision.busy)
                line = wait_line(count, decision)
                if line != shown:  # redrawn only when it changes (a wait may last hours)
                    show(line, False)
                    shown = line
                waited = True
            pause(POLL)
    except BaseException:
        if waited:
            show(f"taas: stopped waiting for {count} GPU(s) after {time.monotonic() - started:.0f} s; "
                 "nothing was started", True)
        raise
    finally:
        place.close()


def for_cell(count: int, job: str, inventory: Callable[[], Sequence[Gpu]], sink, *,
             no_wait: bool = False) -> locks.Lease:
    """:func:`acquire` for job ``job``'s cell: the wait line is the cell's in-place line
    ``taas:gpus`` and the notes go with taas's other warnings (stderr) of ``sink``
    (a :class:`taas.io.output.Sink`: ``progress`` and ``write``)."""
    from taas.leases.inventory import busy_mib

    return acquire(count, holder_for(job), inventory,
                   lambda text, final: sink.progress("taas:gpus", "stderr", text, final),
                   lambda line: sink.write("stderr", line + "\n"),
                   no_wait=no_wait, busy_mib=busy_mib())


def machine_lines(gpus: Sequence[Gpu], path: str | None = None) -> list[str]:
    """``%taas`` and ``taas jobs``: a heading and a line per GPU (free, leased by which job,
    busy outside taas); nothing on a machine with no GPU and no lease."""
    from taas.leases.inventory import busy_mib

    path = path or locks.lock_dir()
    lines = gpu_lines(gpus, locks.held(path), busy_mib())
    return [f"GPUs on this machine (leases in {path}):", *lines] if lines else []
