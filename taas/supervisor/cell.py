"""One cell on kept ranks (``--keep``): started now, or run on the ranks kept from before.

    first cell   launcher.start(spec with TAAS_KEEP=1) ──> ranks run it, say done, wait
    next cells   handle.next_cell(payload) ──> ranks run it in their namespaces, say done
    either       the watch ends when every rank said done (not when processes exit)

A cell's run ends one of three ways:

- every rank said ``done``: the results are fetched (rank 0's, when none failed), or the
  failure rendered as a one-cell job's; the ranks stay (:attr:`KeptCell.kept`);
- Ctrl-C: the ranks' places are taken, then SIGINT is delivered to every rank's main thread;
  when all say ``done`` within :data:`RETURN_WAIT` s, KeyboardInterrupt shows where each was
  and the ranks stay;
- the ranks cannot all come back (a rank failed and a peer does not return within
  :data:`RETURN_WAIT` s, a process ended, an interrupt inside C code, ``--timeout``): the
  hang doctor's view, everything stopped, and one line that the kept state is lost
  (:attr:`KeptCell.kept` is None afterwards).

A cell that reads registered loaders also runs its loader workers, as a job of their own that
ends with the cell (:mod:`taas.supervisor.celldata`).  A loader worker that fails does not stop
the kept ranks: its failure is marked for the ranks' views, which raise it in the cell's code;
once every rank came back, the loader's traceback is shown as the root cause with one line
saying the kept ranks and their state stay.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time

from taas.errors import JobFailed
from taas.io import failure, hang
from taas.io.output import OutputRouter
from taas.job.api import Job
from taas.launch.api import RESULT, LaunchError
from taas.shield import checkpoint, deferred_interrupt, interrupt_thread
from taas.supervisor import diagnosis, events
from taas.supervisor.celldata import Both, CellData
from taas.supervisor.kept import Kept
from taas.supervisor.machine import Ev
from taas.supervisor.supervisor import POLL, STOP_GRACE, Outcome, Supervisor, Watch
from taas.workdir import merge

RETURN_WAIT = 2.0  # seconds the other ranks get to come back after one failed or an interrupt
LOST = ("taas: the kept ranks could not all come back, so they were ended and their state is "
        "lost; the next cell starts fresh ranks")
STAY = "taas: the kept ranks came back from the loader's failure; they and their state stay"


class KeptCell:
    """One cell on kept ranks: :meth:`run` starts them (``kept`` None) or reuses ``kept``."""

    def __init__(self, launcher, job: Job, sink, *, kept: Kept | None, limit: float,
                 name_for=None, on_state=None, on_metrics=None):
        self.supervisor = Supervisor(launcher, job, sink, name_for=name_for, on_state=on_state,
                                     on_metrics=on_metrics)
        self.launcher, self.job, self.sink, self.kept, self.limit = launcher, job, sink, kept, limit

    @property
    def machine(self):
        return self.supervisor.machine

    @property
    def outcome(self) -> Outcome:
        return self.supervisor.outcome

    def run(self) -> Outcome:
        data = CellData(self.launcher, self.job) if self.job.data is not None else None
        try:
            return self._run(data)
        finally:
            if data is not None:  # this cell's loader workers end with it; the ranks stay
                data.finish(self.sink)

    def _start(self, data: CellData | None) -> str | None:
        """Start the ranks (the first cell) or send them the cell, and this cell's loader
        workers; the name rank 0 writes its results to (None: the job's RESULT)."""
        sup, job = self.supervisor, self.job
        if self.kept is None:
            spec = sup._spec(0)  # with loaders: the plane opened, the ranks' views in the payload
            if data is not None:  # the loader workers are a job of their own (celldata.py)
                data.opened = True
                data.start([p for p in spec.processes if p.rank is None])
                spec = dataclasses.replace(spec, processes=tuple(p for p in spec.processes if p.rank is not None),
                                           cleanups=job.cleanups)
            layers = merge.Layers(job.cwd, job.policy.storage == "layer" and job.world.size > 1)
            layers.mark()
            handle = self.launcher.start(spec)
            self.kept = Kept(self.launcher, handle, job.world, job.job_id, layers, self.limit)
            return None
        settings = data.open() if data is not None else {}
        if data is not None:
            data.start()
        payload = f"payload-{job.job_id}.pkl"
        blob = pickle.dumps(dataclasses.replace(job.payload, loaders=settings),
                            protocol=pickle.HIGHEST_PROTOCOL)
        result = f"result-{job.job_id}.pkl"
        try:
            with deferred_interrupt():  # every rank gets the cell, or none does
                self.kept.handle.next_cell({payload: blob}, payload, result)
        except KeyboardInterrupt:  # held while the cell went out: every rank runs it now, so the
            interrupt_thread(threading.get_ident())  # watch's first checkpoint interrupts them
        return result

    def _run(self, data: CellData | None) -> Outcome:
        # Long on purpose: start, watch and the three ways a kept cell ends, in order.
        sup, job = self.supervisor, self.job
        try:
            result_name = self._start(data)
        except LaunchError:
            sup.transition(Ev.LAUNCH_FAILED)
            self._lose(None)
            raise
        sup.transition(Ev.STARTED)
        kept = self.kept
        assert kept is not None
        first = kept.cells == 0
        kept.cells += 1
        watch = None
        handle = kept.handle if data is None or data.handle is None else Both(kept.handle, data.handle)
        try:
            watch = CellWatch(sup, handle, time.monotonic(), up=not first)
            failed = watch.run()
        except BaseException as exc:
            if watch is None or watch.lost:
                self._lose(self.sink)
            hung = self._hung(handle) if data is not None and isinstance(exc, JobFailed) else None
            if hung is not None:
                raise hung from None
            raise
        finally:
            kept.last_used = time.monotonic()
            if watch is not None:
                kept.gpu_mem.update(watch.gpu_mem)
        kept.handle.cell_done()  # every rank came back: what rank 0 wrote is the notebook's now
        if failed:
            sup.transition(Ev.FAILURE)
            sup.transition(Ev.STOPPED)
            raise failed
        sup.transition(Ev.ALL_EXITED)
        if job.policy.results:
            sup.outcome.result = kept.handle.fetch("rank0", result_name or RESULT)
        return sup.outcome

    def _hung(self, handle) -> JobFailed | None:
        """Past --timeout: a loader worker named as the culprit, as a one-cell job does."""
        if self.machine.cause is not Ev.TIMEOUT:
            return None
        return self.job.data.hang(self.job.policy.timeout, self.supervisor.name_for,
                                  lambda key: diagnosis.read_report(handle, key))

    def _lose(self, sink) -> None:
        if self.kept is not None:
            kept, self.kept = self.kept, None
            kept.release(self.sink)
            if sink is not None:
                sink.write("stderr", LOST + "\n")


class CellWatch(Watch):
    """One cell's ranks, watched until every rank said ``done`` (see the module docstring)."""

    def __init__(self, supervisor: Supervisor, handle, started: float, up: bool = True):
        show = supervisor.job.policy.show
        router = OutputRouter(supervisor.sink, handle.keys, set(show) if show is not None else None,
                              tag=supervisor.job.world.size > 1)
        super().__init__(supervisor, handle, router, started)
        if up:  # ranks kept from an earlier cell are up already (--stall counts from now)
            self.up, self.up_at = set(self.ranks), time.monotonic()
        self.failed: dict[str, float] = {}  # rank -> when it said its cell raised
        self.lost = False
        # This cell's loader workers (a job of their own, celldata.py): their ends, and the
        # first that failed, which the ranks' views raise in the cell (plane.fail).
        self.loader_ends: dict[str, failure.ProcessEnd] = {}
        self.loader_failed: failure.ProcessEnd | None = None

    def _on_message(self, key: str, message: events.Message) -> None:
        if isinstance(message, events.Done) and message.failed:
            self.failed.setdefault(key, time.monotonic())
        super()._on_message(key, message)

    def _exited(self, event) -> None:  # any end of a kept process loses the state
        if isinstance(self.handle, Both) and self.handle.is_loader_job(event.key):
            self._loader_exited(event)
            return
        self.ends[event.key] = failure.ProcessEnd(event.key, event.returncode, time.time(),
                                                  stopped=self.lost)
        self.lost = True

    def _loader_exited(self, event) -> None:
        """A loader worker (or relay) of this cell ended: done, or failed -- then the ranks'
        views raise its line in the cell, and the kept ranks come back from it."""
        end = failure.ProcessEnd(event.key, event.returncode, time.time(),
                                 stopped=self.lost or self.stopping)
        self.loader_ends[event.key] = end
        self.board.exited(event.key, event.returncode, stopped=end.stopped)
        if event.returncode == 0 or end.stopped or self.loader_failed is not None:
            return
        end.record = diagnosis.read_report(self.handle, event.key)
        self.loader_failed = end
        if not self.job.data.fail(event.key, failure.summary(end)):
            # Not a loader worker but a transport's process (a cluster node's data relay): the
            # ranks it fed cannot be told, so they cannot all come back from it.
            self.ends[event.key] = end

    def _back(self) -> bool:
        return set(self.ranks) <= self.done and not self.ends

    def run(self) -> JobFailed | None:  # type: ignore[override]
        """None when the cell ran on every rank; the failure when every rank came back from
        it; raises (state lost) when they cannot all come back, KeyboardInterrupt on Ctrl-C."""
        try:
            while not self._back():
                self.deliver(self.handle.events(POLL))
                checkpoint()  # an interrupt of a job run in a thread of its own (taas.shield)
                self.router.tick()
                self.board.tick()
                self.serve_prompts()
                if self.ends:
                    raise self._give_up(None)
                if self.failed and time.monotonic() - min(self.failed.values()) > RETURN_WAIT:
                    raise self._give_up(None)
                self._check_stall()
                self._check_timeout()
        except KeyboardInterrupt as exc:
            self._interrupted_kept(exc)
            raise
        except JobFailed:
            self.lost = True  # --timeout stopped them all
            raise
        finally:
            self.board.close()  # the panel gives way to its summary line, however the cell ends
        self.router.close()
        if self.loader_failed is not None:
            return self._came_back_from_loader(self.loader_failed)
        if not self.failed:
            return None
        return self._came_back_failed()

    def _came_back_from_loader(self, root: failure.ProcessEnd) -> JobFailed:
        """A loader worker failed and every rank came back: its traceback as the root cause,
        what each rank did, and that the kept ranks stay."""
        lines = failure.render(root, [], self.supervisor.name_for)
        for key in self.ranks:
            lines.append(f"{key}: its cell raised the loader's failure" if key in self.failed
                         else f"{key}: ran its cell to the end")
        return JobFailed(failure.summary(root), lines + [STAY], root)

    def _came_back_failed(self) -> JobFailed:
        """The failure of a cell every rank came back from.  Ranks that failed alike (a typo on
        every rank) are ordered by rank, not by the moment each wrote its report (noise): the
        lowest is the root cause (min keeps the first of equals), the others "also failed"."""
        now = time.time()
        ends = [failure.ProcessEnd(k, 1 if k in self.failed else 0, now) for k in self.ranks]
        for end in ends:
            end.record = diagnosis.read_report(self.handle, end.key)
        records = [e.record for e in ends if e.record is not None and e.key in self.failed]
        texts = {str((r.get("chain") or [{}])[-1].get("text")) for r in records}
        if len(texts) == 1 and all(isinstance(r.get("time"), (int, float)) for r in records):
            first = min(r["time"] for r in records)
            for record in records:
                record["time"] = first
        root = failure.root_cause(ends)
        assert root is not None
        others = [end for end in ends if end is not root]
        return JobFailed(failure.summary(root), failure.render(root, others, self.supervisor.name_for), root)

    def _give_up(self, where) -> JobFailed:
        """The ranks cannot all come back: where each is, then stop them all."""
        if where is None:
            where = self.places()
        self.lost = True
        if not self.stopping:
            self.supervisor.transition(Ev.FAILURE)
        self.handle.stop(STOP_GRACE)
        self.deliver(self.handle.drain())
        self.router.replay_hidden("--- recent output of {key} ---")
        self.router.close()
        self.supervisor.transition(Ev.STOPPED)
        ends = [self.ends.get(k) or self.loader_ends.get(k)
                or failure.ProcessEnd(k, None, time.time(), stopped=True) for k in self.keys]
        for end in ends:
            if end.key in self.failed:
                end.seen_at = self.failed[end.key]
        if any(e.failed for e in ends) or any(diagnosis.read_report(self.handle, e.key) for e in ends):
            failed = diagnosis.job_failed(self.handle, ends, self.supervisor.name_for)
        else:
            failed = JobFailed("the kept ranks ended", [])
        return JobFailed(failed.summary, failed.rendered + hang.render(where, self.supervisor.name_for),
                         failed.report)

    def _interrupted_kept(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C: KeyboardInterrupt in every rank's cell; the ranks stay when all return."""
        name_for = self.supervisor.name_for
        try:
            where = self.places()  # before anything is interrupted
            self.handle.interrupt([k for k in self.ranks if k not in self.done])
            deadline = time.monotonic() + RETURN_WAIT
            while not self._back() and not self.ends and time.monotonic() < deadline:
                self.deliver(self.handle.events(POLL))
                self.router.tick()
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once
            where = []
        if self._back():
            self.router.close()
            self.supervisor.transition(Ev.INTERRUPT)
            lines = ["KeyboardInterrupt: the cell was interrupted on every rank; the kept ranks "
                     "and their state stay"] + hang.render(where, name_for)
        else:
            self.lost = True
            self.supervisor.transition(Ev.INTERRUPT)
            self.handle.stop(STOP_GRACE)
            self.router.close()
            lines = ["KeyboardInterrupt: the cell was interrupted; the ranks did not all return "
                     "within a few seconds"] + hang.render(where, name_for)
        if self.supervisor.machine.state.value == "stopping":
            self.supervisor.transition(Ev.STOPPED)
        exc._render_traceback_ = lambda: list(lines)  # type: ignore[attr-defined]
        exc.add_note("\n".join(lines[1:]))
