"""What every job of a cell goes through around its run, whoever runs it: the cell read
(compiled, analysed, the notebook values it reads: the Session's jobs and a job host's client
both start there), rank 0's taas.log drawn live, the notes after a job whose ranks all
succeeded, and what is settled however a job ended (its files, its figures).

Plain functions over a Job and a Sink; no IPython, no processes of their own.  The session
(the composition root) calls them for a one-cell job and for a cell on kept ranks alike.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from taas.io import failure, keys
from taas.io.output import INFO, WARN, Sink
from taas.io.output import note as write_note
from taas.io.plot import LivePlot
from taas.job import analysis, package
from taas.job import metrics as job_metrics
from taas.job.api import Job, JobStats
from taas.job.memory.bigvalues import BigValues
from taas.rank import comm

if TYPE_CHECKING:
    from taas.data.plane import DataPlane


def read_cell(source: str, namespace: dict, filename: str, first_line: int, hidden: frozenset = frozenset(),
              name_for=None):
    """The cell compiled (a syntax error shown as Python shows it, with the cell's own lines),
    analysed, and the notebook values it reads: what every job of a cell starts from, here or
    in a job host (taas.host.client)."""
    try:
        _compiles(source, first_line)
    except SyntaxError:  # shown with the cell's own name and lines
        try:
            analysis.compile_cell(source, filename, first_line)
        except SyntaxError as exc:
            raise failure.syntax_error(exc, name_for) from None
    cell = analysis.analyse(source)
    return cell, package.select(cell.free, namespace, hidden)


@functools.lru_cache(maxsize=64)
def _compiles(source: str, first_line: int) -> bool:
    """Whether ``source`` compiles (a SyntaxError raised, never remembered): whether a cell
    compiles does not depend on its file name, which changes with every run of it, so a cell
    run again is not compiled again here (a few tenths of a millisecond of every kept cell)."""
    analysis.compile_cell(source, "<taas cell>", first_line)
    return True


def live_plot(job: Job, sink: Sink):
    """Rank 0's taas.log scalars, drawn live in the cell: the plot, and the supervisor's
    ``on_metrics`` that feeds it."""
    history = job_metrics.HISTORY
    plot = LivePlot(sink, lambda: history.series(job.job_id, rank=0))
    return plot, lambda key, rows: plot.changed(history.add(job.job_id, keys.rank_of(key), rows))


def succeeded(job: Job, outcome, plane: DataPlane | None, stats: JobStats, sink: Sink) -> None:
    """After a job whose ranks all succeeded: the line when each rank trained alone, and the
    loaders' summary."""
    stats.outcome = "ok"
    alone = comm.note(job.world.size, outcome.comm_ops, outcome.trained)
    if alone:
        write_note(sink, alone, WARN)
    if plane is not None:
        stats.data = plane.summary()
        for line in stats.data:
            write_note(sink, line, INFO)


def settle(plot: LivePlot, big: BigValues, stats: JobStats, started: float, outcome) -> None:
    """However the job ended: the plot's last frame, the big values' files (a rank still
    running keeps its mapping), the job's figures for ``%taas``."""
    plot.close()
    big.close_fds()
    big.unlink(wait=False)
    stats.wall_s = time.monotonic() - started
    stats.exit_codes = outcome.exit_codes
    stats.comm_ops = outcome.comm_ops
