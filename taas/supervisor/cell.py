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
"""

from __future__ import annotations

import dataclasses
import pickle
import time

from taas.errors import JobFailed
from taas.io import failure, hang
from taas.io.output import OutputRouter
from taas.job.api import Job
from taas.launch.api import RESULT, LaunchError
from taas.shield import deferred_interrupt
from taas.supervisor import diagnosis, events
from taas.supervisor.kept import Kept
from taas.supervisor.machine import Ev
from taas.supervisor.supervisor import POLL, STOP_GRACE, Outcome, Supervisor, Watch
from taas.workdir import merge

RETURN_WAIT = 2.0  # seconds the other ranks get to come back after one failed or an interrupt
LOST = ("taas: the kept ranks could not all come back, so they were ended and their state is "
        "lost; the next cell starts fresh ranks")


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
        sup, job = self.supervisor, self.job
        result = f"result-{job.job_id}.pkl"
        try:
            if self.kept is None:
                layers = merge.Layers(job.cwd, job.policy.storage == "layer" and job.world.size > 1)
                layers.mark()
                handle = self.launcher.start(sup._spec(0))
                self.kept = Kept(self.launcher, handle, job.world, job.job_id, layers, self.limit)
                result_name = None
            else:
                payload = f"payload-{job.job_id}.pkl"
                data = pickle.dumps(dataclasses.replace(job.payload, loaders={}),
                                    protocol=pickle.HIGHEST_PROTOCOL)
                with deferred_interrupt():  # every rank gets the cell, or none does
                    self.kept.handle.next_cell({payload: data}, payload, result)
                result_name = result
        except LaunchError:
            sup.transition(Ev.LAUNCH_FAILED)
            self._lose(None)
            raise
        sup.transition(Ev.STARTED)
        kept = self.kept
        first = kept.cells == 0
        kept.cells += 1
        watch = None
        try:
            watch = CellWatch(sup, kept.handle, time.monotonic(), up=not first)
            failed = watch.run()
        except BaseException:
            if watch is None or watch.lost:
                self._lose(self.sink)
            raise
        finally:
            kept.last_used = time.monotonic()
        kept.handle.cell_done()  # every rank came back: what rank 0 wrote is the notebook's now
        if failed:
            sup.transition(Ev.FAILURE)
            sup.transition(Ev.STOPPED)
            raise failed
        sup.transition(Ev.ALL_EXITED)
        if job.policy.results:
            sup.outcome.result = kept.handle.fetch("rank0", result_name or RESULT)
        return sup.outcome

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

    def _on_message(self, key: str, message: events.Message) -> None:
        if isinstance(message, events.Done) and message.failed:
            self.failed.setdefault(key, time.monotonic())
        super()._on_message(key, message)

    def _exited(self, event) -> None:  # any end of a kept process loses the state
        self.ends[event.key] = failure.ProcessEnd(event.key, event.returncode, time.time(),
                                                  stopped=self.lost)
        self.lost = True

    def _back(self) -> bool:
        return set(self.ranks) <= self.done and not self.ends

    def run(self) -> JobFailed | None:  # type: ignore[override]
        """None when the cell ran on every rank; the failure when every rank came back from
        it; raises (state lost) when they cannot all come back, KeyboardInterrupt on Ctrl-C."""
        try:
            while not self._back():
                self.deliver(self.handle.events(POLL))
                self.router.tick()
                self.board.tick()
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
        if not self.failed:
            return None
        return self._came_back_failed()

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
        ends = [self.ends.get(k) or failure.ProcessEnd(k, None, time.time(), stopped=True)
                for k in self.keys]
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
