"""A kept rank's life after its first cell (``--keep``): wait for the next cell, run it in the
same namespace, on the same process group, until released.

    first cell (rank/main.py) ──> done ──> wait on the cell FIFO (taas.launch.process.cells)
        NextCell(payload, result) ──> unship the names sent ──> run ──> done | done(failed)
        Release ──> leave (exit 0)

A cell that reads registered loaders gets this cell's views of them before it runs (waiting
for the first slice, as a one-cell job's rank does) and closes them, releasing what they hold,
before ``done``: each cell's loader workers are a job of their own that ends with the cell
(:mod:`taas.supervisor.celldata`).  A loader worker's failure reaches the cell as the view's
:class:`taas.data.view.LoaderFailed`, a cell exception like any other.

A cell's exception (a typo on every rank, a KeyboardInterrupt the kernel delivered as SIGINT)
writes the rank's failure report as a one-cell job does, then says ``done`` with
``failed=true`` and waits for the next cell: the state stays.  The kernel removes the reports
before it sends the next cell.  ``sys.exit`` in a kept cell ends the rank as it does in a
one-cell job (main.py's handling); the kernel then finds the kept state lost.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Callable

from taas.job import results
from taas.job.package import Payload, unship
from taas.launch.process import cells, events, report, stacks
from taas.rank import comm, console, heartbeat, metrics
from taas.shield import deferred_interrupt

log = logging.getLogger(__name__)

KEEP_ENV = "TAAS_KEEP"  # "1": this rank is kept between cells


def kept() -> bool:
    return os.environ.get(KEEP_ENV) == "1"


def run(job_dir: str, key: str, rank: int, payload: Payload, namespace: dict,
        run_cell: Callable[[Payload, dict], object], result: str | None) -> None:
    """Run one cell on this kept rank and say ``done`` however it ended (but sys.exit, which
    ends the rank).  ``result``: where rank 0 writes its results (None: the job's RESULT).
    The cell's ``comm`` counts go with ``done``, in one write (one wake of the kernel)."""
    counted = None
    try:
        _open_views(payload, namespace)  # waits for the first slice, as a one-cell rank does
        heartbeat.running()
        before = results.Before(namespace) if rank == 0 and payload.results else None
        out = run_cell(payload, namespace)
        counted = comm.counts()
        if before is not None:
            # The kernel reads big storages out of this process, on the channel the kept ranks
            # got with their first cell (it lives as long as they do: taas.supervisor.kept).
            data = results.encode(results.collect(namespace, before.bound(namespace, payload.bound), out,
                                                  to_cpu=payload.results_to_cpu,
                                                  channel=results.channel_from(os.environ)))
            if result is None:
                report.write_result(job_dir, data)
            else:
                _write(os.path.join(job_dir, result), data)
        failed = False
    except SystemExit:
        raise
    except BaseException as exc:  # the user's error, or the kernel's interrupt (SIGINT)
        console.remember(exc)  # %taas debug opens it later
        if console.quitting(exc):  # q in the debugger: the cell fails, the ranks stay
            report.write_error(job_dir, key, None, 1, console.QUIT_KEPT)
        else:
            if payload.post_mortem and not isinstance(exc, KeyboardInterrupt):
                console.post_mortem(exc)  # IPython's %pdb on
            report.write_error(job_dir, key, exc, 1)
        failed = True
    # The cell is over: an interrupt now (the kernel's, for a cell it saw running) is held until
    # "done" went out, then dropped by serve(); raised here it would end the rank, and the state.
    with deferred_interrupt():
        _close_views()  # their figures go out before "done"; the cell's loader workers end now
        heartbeat.stop()  # an idle kept rank sends nothing until its next cell
        sys.stdout.flush()
        sys.stderr.flush()
        # What the rank's tensors hold on its GPU as it waits (%taas shows it between cells).
        gpu = int(os.environ.get("LOCAL_RANK", "0")) if payload.device == "cuda" else None
        done = ("done", {"failed": failed, "gpu_mem": heartbeat.gpu_memory(gpu)})
        events.send_many(*([("comm", counted)] if counted is not None else []), done)


def serve(job_dir: str, key: str, rank: int, inbox: cells.Inbox, namespace: dict,
          run_cell: Callable[[Payload, dict], object], resolve: Callable[[str], object]) -> int:
    """Cells until released; the exit code."""
    while True:
        try:
            message = inbox.next()
        except KeyboardInterrupt:  # a late interrupt of the cell that just ended: not ours
            continue
        if isinstance(message, cells.Release):
            log.debug("rank %d released", rank)
            return 0
        try:
            with open(os.path.join(job_dir, message.payload), "rb") as f:
                payload: Payload = pickle.load(f)
            stacks.set_cell(payload.filename)
            heartbeat.start(payload.filename, payload.device)  # the panel, as in a one-cell job
            metrics.new_cell()
            namespace = _merge(namespace, unship(payload.names, resolve=resolve))
        except KeyboardInterrupt as exc:
            heartbeat.stop()
            report.write_error(job_dir, key, exc, 1)
            events.send("done", failed=True)
            continue
        log.debug("rank %d: kept cell %s", rank, payload.filename)
        try:
            run(job_dir, key, rank, payload, namespace, run_cell, message.result)
        except KeyboardInterrupt:  # held until the cell said done (run): a late one, not ours
            continue


def _open_views(payload: Payload, namespace: dict) -> None:
    """This cell's views of the registered loaders it reads (none: nothing to do)."""
    if payload.loaders:
        from taas.data.view import install_views

        install_views(payload.loaders, namespace)


def _close_views() -> None:
    views = sys.modules.get("taas.data.view")
    if views is not None:
        views.close_views(release=True)


def _merge(kept: dict, sent: dict) -> dict:
    """The namespace the next cell runs in: the kept one with the names sent over it.  When
    the names sent bring notebook functions, their globals dict is ``sent`` (see
    :func:`taas.job.package.unship`): the cell then runs in that dict, with every kept name
    the cell did not send copied in, so a sent function sees the ranks' own names."""
    if not sent:
        return kept
    if any(getattr(v, "__globals__", None) is sent for v in sent.values()):
        for name, value in kept.items():
            sent.setdefault(name, value)
        return sent
    kept.update(sent)
    return kept


def _write(path: str, data: bytes) -> None:
    """Whole or not at all: the kernel never reads half a file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
