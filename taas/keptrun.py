"""The session's kept ranks (``--keep``): which kept ranks a cell runs on, a cell's run on them,
``%taas debug`` and ``%taas release``.  A part of :class:`taas.session.Session` (its base
class), apart so that each stays readable; the bookkeeping itself is
:mod:`taas.supervisor.kept` (Kept, Keeper) and a cell's run :mod:`taas.supervisor.cell`.
No IPython here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any

from taas import cellrun, directive
from taas.errors import JobFailed
from taas.io import keys
from taas.io.output import Sink
from taas.job import results
from taas.job.api import Job, JobStats
from taas.job.memory.bigvalues import BigValues
from taas.job.results import CellResult
from taas.supervisor.cell import KeptCell
from taas.supervisor.kept import Kept, Keeper, debug_cell


class KeptRanks:
    """What :class:`~taas.session.Session` does with kept ranks (the Session has ``_state``
    and ``run_cell``, and these attributes)."""

    keeper: Keeper  # the session's slot for kept ranks
    last: JobStats | None  # what %taas says of the last job
    _shipped: dict  # what the cell being prepared sends to kept ranks
    _debugging: bool  # %taas debug runs its cell (it keeps failed_rank)
    launcher: Any  # this machine's
    job_host: Any  # the kernel's job host (taas.host.remote.KernelHost), or None
    _running: threading.Lock  # one job at a time

    def _kept_for(self, launcher, options: directive.JobOptions, sink: Sink, cuda_devices) -> Kept | None:
        """The kept ranks this cell runs on, or None (see :meth:`Keeper.reuse`)."""
        def world(kept: Kept) -> tuple:  # what this cell asks for; no --gpus: the kept size
            wanted = options if options.gpus is not None else dataclasses.replace(options, gpus=kept.world.size)
            return directive.resolve_world(wanted, cuda_devices(), launcher.where)[:3]

        return self.keeper.reuse(launcher, world, options.fresh, options.keep, sink)

    def _run_kept(self, launcher, job: Job, big: BigValues, options: directive.JobOptions,
                  sink: Sink, name_for) -> CellResult:
        """``job`` on kept ranks (started now when none are kept); they stay afterwards
        unless they could not all come back (taas.supervisor.kept)."""
        stats = self.last
        assert stats is not None
        limit = options.keep if options.keep is not None else directive.KEEP_DEFAULT
        plot, on_metrics = cellrun.live_plot(job, sink)
        # In the host that keeps them (kept ranks adopted from a detached job: its host), else in
        # the kernel's job host (taas.host.remote) when it has one, as a one-cell job is.
        host = getattr(self.kept, "host", None)
        if host is None and launcher is self.launcher:
            host = self.job_host
        make = host.kept_cell if host is not None else KeptCell
        run = make(launcher, job, sink, kept=self.kept, limit=limit, name_for=name_for,
                   on_state=lambda state: self._state(stats, state), on_metrics=on_metrics)
        shipped, self._shipped = self._shipped, {}
        started = time.monotonic()
        try:
            try:
                outcome = run.run()
            except JobFailed as failed:  # %taas debug's default rank: the root cause's
                if run.kept is not None and not self._debugging:
                    run.kept.failed_rank = keys.rank_of(failed.report.key) if failed.report else None
                raise
            if run.kept is not None and not self._debugging:
                run.kept.failed_rank = None
            cellrun.succeeded(job, outcome, job.data, stats, sink)
            if not job.policy.results or outcome.result is None:
                return CellResult()
            channel = big.channel or (run.kept.channel if run.kept is not None else None)
            back = results.load(results.decode(outcome.result), channel)
            stats.results = back.big
            shipped.update(back.values)  # the ranks hold what came back: not sent again
            return back
        finally:
            if run.kept is not None and run.kept.channel is None:  # they just started: theirs
                run.kept.channel, big.channel = big.channel, None
            self.keeper.after_cell(run.kept, shipped)
            cellrun.settle(plot, big, stats, started, run.outcome)

    @property
    def kept(self) -> Kept | None:
        return self.keeper.kept

    def debug(self, rank: int | None = None, sink: Sink | None = None, name_for=None) -> None:
        """``%taas debug [RANK]``: on kept ranks, the debugger at the frame where rank ``RANK``'s
        last failed cell raised (default: the root cause of the last failed cell), in this
        cell's input box; leaving it (``q``, ``c``) keeps the ranks and their state."""
        source = debug_cell(self.kept, rank)
        self._debugging = True
        try:
            self.run_cell(source, {}, directive.parse_options("--no-results"), filename="<taas debug>",
                          sink=sink, name_for=name_for)
        finally:
            self._debugging = False

    def release(self, sink: Sink | None = None) -> str | None:
        """``%taas release``: end the kept ranks; a line saying what ended, or None."""
        return self.keeper.release(sink)

    def adopt(self, kept: Kept, values: dict, sink: Sink | None = None) -> str | None:
        """``%taas attach`` on a kept detached job: its ranks (``kept``, a RemoteKept reaching
        their host) are this session's kept ranks from now on, holding ``values`` (their first
        cell's results, landed in the notebook); this session's own are released first (the
        line saying so, or None), other adopted ones let go (they wait for the next kernel)."""
        with self.hold():
            line = self.keeper.let_go(sink)
            self.keeper.after_cell(kept, values)
        return line

    @contextlib.contextmanager
    def hold(self):
        """No cell runs, and the idle limit ends no kept ranks, meanwhile (a kept job's host runs
        its adopting kernel's cells with it held)."""
        with self._running:
            yield
