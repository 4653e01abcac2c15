"""Kept ranks (``--keep``): the kernel's bookkeeping of ranks that live between cells.

* :class:`Kept`: one kept job: its handle, its world, when it was last used, its idle limit,
  and a fingerprint of every notebook value its ranks hold (:func:`fingerprint`), so that a
  cell sends only what they lack or the notebook changed; ``%taas``'s line about it.
* :class:`Keeper`: the session's slot for it: the idle limit's timer, why kept ranks ended
  while no cell ran (the next cell says so), release.

A cell's run on kept ranks is :mod:`taas.supervisor.cell`.  The storage rule's layers are
merged when the kept ranks end (their overlays stay mounted while they live).
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
import weakref

from taas.errors import LaunchError
from taas.io import keys as names
from taas.io.output import TerminalSink
from taas.job.api import World
from taas.shield import deferred_interrupt
from taas.supervisor.supervisor import STOP_GRACE
from taas.workdir import merge

log = logging.getLogger(__name__)


class Kept:
    """The kernel's bookkeeping of one kept job: its handle and what its ranks hold."""

    def __init__(self, launcher, handle, world: World, job_id: str, layers: merge.Layers,
                 limit: float):
        self.launcher, self.handle, self.world, self.job_id = launcher, handle, world, job_id
        self.layers, self.limit = layers, limit
        self.started = self.last_used = time.monotonic()
        self.cells = 0
        # notebook name -> fingerprint of the value the ranks hold under it (shipped or
        # brought back): what the next cell need not send again (taas.supervisor.fingerprint).
        self.held: dict[str, object] = {}
        # The first cell's results channel (taas.job.memory.channel), kept for the ranks' life:
        # their rank 0 holds its other end, so every kept cell's big results come back on it.
        self.channel = None
        self.gpu_mem: dict[str, int] = {}  # rank -> GPU bytes its tensors held after its last cell
        self.failed_rank: int | None = None  # the root cause of the last cell, when it failed
        self.whose = ""  # what the lines about them add to "the kept ranks (4 on cuda/nccl)"
        self.adopted = False  # a detached job's, which this kernel adopted: they outlive it (let_go)

    def let_go(self) -> None:
        """Stop holding them without ending them: only adopted ones can (see RemoteKept)."""
        self.release()

    def remember(self, name: str, value) -> None:
        """The ranks now hold ``value`` under ``name`` (it was shipped, or brought back)."""
        try:
            ref = weakref.ref(value)
        except TypeError:  # no weak references (ints, tuples...): its fingerprint says it all
            ref = None
        self.held[name] = (fingerprint(value), ref)

    def holds(self, name: str, value) -> bool:
        """Whether the ranks hold ``value`` as the notebook has it under ``name``."""
        entry = self.held.get(name)
        if entry is None:
            return False
        print_, ref = entry
        # The weak reference rules out a new object that reuses a freed one's id.
        return (ref is None or ref() is value) and print_ == fingerprint(value)

    def idle(self) -> float:
        return time.monotonic() - self.last_used

    def expired(self) -> bool:
        return self.idle() > self.limit

    def describe(self) -> str:
        limit = "" if math.isinf(self.limit) else f", released after {_span(self.limit)} idle"
        # Measured where the ranks run (the launcher's business: a cluster asks its nodes).
        memory = ", ".join(f"{k} {rss / 2**20:.0f} MiB" for k, rss in sorted(
            self.handle.memory().items(), key=lambda kv: names.order(kv[0])))
        reserved = self.handle.reserved()
        # Told by the ranks as each cell ended (torch's allocated bytes, as the rank panel shows).
        gpu = ", ".join(f"{k} {b / 2**20:.0f} MiB" for k, b in sorted(
            self.gpu_mem.items(), key=lambda kv: names.order(kv[0])))
        return (f"kept ranks{self.whose}: {self.world.size} on {self.world.device}/{self.world.backend} on "
                f"{self.launcher.where}, {self.cells} cell(s), idle {_span(self.idle())}{limit}"
                + (f"; {reserved}" if reserved else "")
                + (f"; memory (RSS) {memory}" if memory else "")
                + (f"; GPU memory (torch, after the last cell) {gpu}" if gpu else ""))

    def flag(self) -> str:
        return "--keep" if math.isinf(self.limit) else f"--keep {self.limit:g}s"

    def release(self, sink=None) -> None:
        """End the ranks: stop, merge the ranks' layers, free the job's resources."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        try:
            handle.stop(STOP_GRACE)
            # The ranks' layers come back now (the timer and unload have no cell: stderr).
            self.layers.merge(handle.layers(), self.job_id, sink or TerminalSink())
        finally:
            with deferred_interrupt():  # a Ctrl-C here would leak the channel's descriptors
                handle.close()
                channel, self.channel = self.channel, None
                if channel is not None:
                    channel.close()


# %taas debug RANK: the cell every kept rank runs (taas.rank.console.debug_last).
DEBUG_CELL = "__import__('taas.rank.console', fromlist=['debug_last']).debug_last({rank})\n"


def debug_cell(kept: Kept | None, rank: int | None) -> str:
    """``%taas debug [RANK]``'s cell for ``kept`` (default rank: the root cause of the last
    cell, when it failed); LaunchError (one line) when there is nothing to debug."""
    if kept is None:
        raise LaunchError("taas: %taas debug needs kept ranks (--keep) whose cell failed; there are none")
    if rank is None:
        rank = kept.failed_rank
        if rank is None:
            raise LaunchError("taas: the kept ranks' last cell did not fail; "
                              "%taas debug RANK opens the last failure of rank RANK")
    if not 0 <= rank < kept.world.size:
        raise LaunchError(f"taas: there is no rank {rank}: the kept ranks are 0-{kept.world.size - 1}")
    return DEBUG_CELL.format(rank=rank)


SMALL = 1 << 16  # bytes: plain values up to this size are fingerprinted by their pickle


def fingerprint(value) -> object:
    """What tells whether the ranks still hold ``value`` as the notebook has it: a tensor's
    identity and version counter (bumped by every in-place change), a module's identity and
    its parameters' versions, a small plain value's pickle, else the identity."""
    version = getattr(value, "_version", None)
    if isinstance(version, int) and hasattr(value, "data_ptr"):  # a torch tensor
        return ("tensor", id(value), version)
    parameters = getattr(value, "parameters", None)
    if callable(parameters) and hasattr(value, "state_dict"):  # an nn.Module
        try:
            return ("module", id(value), tuple(p._version for p in parameters()))
        except Exception:  # a module whose parameters() misbehaves: identity only
            return ("id", id(value))
    if isinstance(value, (int, float, complex, str, bytes, bool, tuple, list, dict, set,
                          frozenset, type(None))):
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # holds something unpicklable: identity is the best we have
            return ("id", id(value))
        if len(blob) <= SMALL:
            return ("pickle", blob)
    return ("id", id(value))


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Keeper:
    """The session's kept ranks, if any; ``lock`` is the session's one-job-at-a-time lock (the
    idle limit's timer ends the ranks only while no cell runs)."""

    def __init__(self, lock: threading.Lock):
        self.kept: Kept | None = None
        self._lock = lock
        self._timer: threading.Timer | None = None
        self._note: str | None = None  # why the kept ranks ended while no cell ran
        self.releasing = False  # the timer is ending them (holding the session's lock)

    def take(self, sink) -> Kept | None:
        """At a cell's start: the kept ranks (the timer stops), or None after saying why the
        last ones ended meanwhile."""
        if self._timer is not None:
            self._timer.cancel()
        if self.kept is None and self._note:
            sink.write("stderr", self._note + "\n")
            self._note = None
        return self.kept

    def reuse(self, launcher, world, fresh: bool, limit: float | None, sink) -> Kept | None:
        """At a cell's start: the kept ranks it runs on, or None.  Kept ranks that lost a
        process, passed their idle limit, run elsewhere or as another world (``world(kept)``:
        the cell's (size, device, backend)), or meet ``--fresh``, are ended first, with one
        line saying why.  ``limit``: the cell's ``--keep`` limit, which replaces theirs."""
        kept = self.take(sink)
        if kept is None:
            return None
        was = kept.world
        why = None
        lost = kept.handle.lost()
        if lost is not None:
            why = f"{lost}, so their state is lost"
        elif kept.expired():
            why = f"they were idle longer than their limit ({kept.flag()})"
        elif fresh:
            why = "--fresh"
        elif launcher is not kept.launcher:
            why = "this cell runs elsewhere"
        else:
            size, device, backend = world(kept)
            if (size, device, backend) != (was.size, was.device, was.backend):
                why = f"this cell asks for {size} rank(s) on {device}/{backend}"
        if why is None:
            if limit is not None:
                kept.limit = limit
            return kept
        self.release(sink)
        sink.write("stderr", f"taas: released the kept ranks ({was.size} on {was.device}/"
                   f"{was.backend}){kept.whose}: {why}; this cell starts fresh ranks\n")
        return None

    def after_cell(self, kept: Kept | None, shipped: dict) -> None:
        """A cell ended on kept ranks (``kept`` None: they were lost): remember what they hold
        now and arm the idle limit."""
        self.kept = kept
        if kept is None:
            return
        for name, value in shipped.items():
            kept.remember(name, value)
        if not math.isinf(kept.limit):
            self._timer = threading.Timer(max(0.0, kept.limit - kept.idle()) + 0.05, self._idle, (kept,))
            self._timer.daemon = True
            self._timer.start()

    def _idle(self, kept: Kept) -> None:
        self.releasing = True  # before the lock: a cell starting now waits for us
        if not self._lock.acquire(blocking=False):
            self.releasing = False
            return  # a cell is running: it decides (the session's _kept_for)
        try:
            if self.kept is kept and kept.expired():
                world = kept.world
                self.release()
                self._note = (f"taas: the kept ranks ({world.size} on {world.device}/{world.backend}) "
                              f"were released after {_span(kept.limit)} idle ({kept.flag()}); this "
                              "cell starts fresh ranks")
        finally:
            self.releasing = False
            self._lock.release()

    def let_go(self, sink=None) -> str | None:
        """The kernel goes (``%unload_ext``) or adopts others: its own kept ranks end (the line
        saying so), adopted ones wait for the next kernel (None)."""
        kept = self.kept
        if kept is not None and kept.adopted:
            self.kept = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            kept.let_go()
            return None
        return self.release(sink)

    def release(self, sink=None) -> str | None:
        """End the kept ranks; a line saying what ended, or None when there were none."""
        kept, self.kept = self.kept, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if kept is None:
            return None
        kept.release(sink)
        world = kept.world
        return f"taas: released the kept ranks ({world.size} on {world.device}/{world.backend}){kept.whose}"
