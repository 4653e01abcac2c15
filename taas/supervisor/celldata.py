"""A kept cell's registered loaders: that cell's loader workers, as a job of their own.

Kept ranks (``--keep``) outlive their cells; loader workers must not (each cell gets its loader
workers and every unit once, as a one-cell job does).  So a kept cell that reads registered
loaders runs two jobs on the launcher side by side: the kept ranks' (started by the first
cell, reused after) and this cell's loader job (its loader workers and the transport's own
processes, started with the cell, ended with it)::

    CellData.start()     plane.open(job id) -> the loader job's LaunchSpec -> launcher.start
    Both(kept, loaders)  the two handles watched as one (supervisor/cell.py's CellWatch)
    CellData.finish()    stop the loader job, merge its layers, close it and the data plane

The launcher must route its processes' control messages to the job they are about, as the
local one does (:mod:`taas.launch.local.mailboxes`).
"""

from __future__ import annotations


from taas.io import keys as names
from taas.job.api import Job
from taas.launch.api import JobHandle, LaunchSpec, ProcessSpec
from taas.shield import deferred_interrupt
from taas.supervisor.supervisor import STOP_GRACE
from taas.workdir import merge
from taas.ready import readable

LOADER_JOB = "{job}-data"  # the loader job's id (the kept ranks' job may carry the cell's id)


class CellData:
    """One kept cell's loader job (``job.data``: the cell's DataPlane)."""

    def __init__(self, launcher, job: Job):
        self.launcher, self.job, self.plane = launcher, job, job.data
        self.handle: JobHandle | None = None
        self.layers = merge.Layers(job.cwd, job.policy.storage == "layer")
        self.opened = False

    def open(self) -> dict:
        """Make the loaders' channels: the settings this cell's rank views attach with."""
        self.plane.open(self.job.job_id, self.job.transport)
        self.opened = True
        return self.plane.settings

    def processes(self) -> list[ProcessSpec]:
        return self.plane.processes(self.job.env, self.job.policy.storage)

    def start(self, processes: list[ProcessSpec] | None = None) -> JobHandle:
        """Start the loader workers (``processes``: already built, else the plane's)."""
        if not self.opened:
            self.open()
        job = self.job
        spec = LaunchSpec(
            job_id=LOADER_JOB.format(job=job.job_id), cwd=job.cwd,
            processes=tuple(processes if processes is not None else self.processes()),
            files={}, shared_fds=(), device=job.world.device,
            cleanups=tuple(self.plane.cleanups()))
        self.layers.mark()
        self.handle = self.launcher.start(spec)
        return self.handle

    def finish(self, sink) -> None:
        """The cell is over: its loader workers end (the kept ranks stay), their layers come
        back, the data plane's resources go.  Safe to call however far :meth:`start` got."""
        with deferred_interrupt():  # a second Ctrl-C must not leave workers or shared memory
            handle, self.handle = self.handle, None
            if handle is not None:
                try:
                    handle.stop(STOP_GRACE)
                    self.layers.merge(handle.layers(), self.job.job_id, sink)
                finally:
                    handle.close()
            if self.opened:
                self.plane.finish(sink)
                self.plane.close()


class Both(JobHandle):
    """The kept ranks' handle and a cell's loader job's, watched as one: keys of both, events
    of both, a key's calls to the handle that has it.  ``stop`` ends both (the kept state is
    lost then); the ranks' calls (``interrupt``, ``lost``, ``next_cell``) go to the kept one."""

    def __init__(self, kept: JobHandle, loaders: JobHandle):
        self.kept, self.loaders = kept, loaders
        self._loader_keys = set(loaders.keys)

    def of(self, key: str) -> JobHandle:
        return self.loaders if key in self._loader_keys else self.kept

    @property
    def keys(self) -> list[str]:
        return list(self.kept.keys) + list(self.loaders.keys)

    def is_loader_job(self, key: str) -> bool:
        return key in self._loader_keys

    def events(self, timeout: float):
        # Each handle may read the other's control messages from a shared channel (they are
        # routed, not lost): so ask both, then the first again, before waiting on either.
        out = self._round()
        if out or timeout <= 0:
            return out
        fds = [h.fileno() for h in (self.kept, self.loaders)]
        if None not in fds:
            readable(fds, timeout)
            return self._round()
        return list(self.kept.events(0)) + list(self.loaders.events(timeout))

    def _round(self) -> list:
        return list(self.kept.events(0)) + list(self.loaders.events(0)) + list(self.kept.events(0))

    def drain(self, timeout: float = 2.0):
        return list(self.kept.drain(timeout)) + list(self.loaders.drain(timeout))

    def stop(self, grace: float = 1.0) -> None:
        self.loaders.stop(grace)
        self.kept.stop(grace)

    def fetch(self, key: str, name: str):
        return self.of(key).fetch(key, name)

    def request_stacks(self, keys):
        ranks = [k for k in keys if names.is_rank(k)]
        return list(self.kept.request_stacks(ranks)) if ranks else []

    def layers(self):
        return list(self.kept.layers()) + list(self.loaders.layers())

    def answer(self, key, reply):
        return self.kept.answer(key, reply)

    def close(self) -> None:
        self.loaders.close()

    def interrupt(self, keys):
        return self.kept.interrupt(keys)

    def lost(self):
        return self.kept.lost()

    def running_pids(self):
        return self.kept.running_pids()
