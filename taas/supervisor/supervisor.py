"""The supervisor: runs one :class:`~taas.job.api.Job` on a launcher, through explicit states.

::

                 ┌────────── launch failed ─────────────────────────────> FAILED
                 │
    PREPARING ───┴─ started ─┬─ (loaders) ─> PREFETCHING ─ loaders ready ─┐
        ▲                    └─ (none) ────────────────────────────────> RUNNING ─ all exited 0 ─> SUCCEEDED
        │                                     │                            │   (PREFETCHING too)
        │                                     └── failure | timeout | interrupt ──> STOPPING
        │                                                                             │ stopped
        │                        ┌──────────── the cause was a failure, restarts left ┤
        └──── restart ──── RESTARTING                                                 ├─ failure ──> FAILED
                                                                                      ├─ timeout ──> TIMED_OUT
                                                                                      └─ interrupt ─> INTERRUPTED
    An interrupt in PREPARING or RESTARTING ends in INTERRUPTED at once; one while STOPPING
    makes the cause an interrupt (no restart).

:class:`Machine` is that diagram as a table (pure, tested as data); :class:`Supervisor` drives
a job through it: per attempt it opens the data plane, builds the :class:`LaunchSpec`, starts
it, pumps output to the router until every process ended, stops everything at the first
failure, merges the ranks' layers and brings back rank 0's results -- all through the
launcher's :class:`~taas.launch.api.JobHandle`.

Policy: ``--timeout`` bounds the whole job (restarts included) and is not restarted; a failed
attempt starts again from scratch (fresh processes, each registered loader's units delivered
again, exactly once per attempt, as a restarted torchrun job re-creates its DataLoaders) with
``TORCHELASTIC_RESTART_COUNT`` one higher.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import pickle
import time
from dataclasses import dataclass, field

from taas.errors import JobFailed, LaunchError
from taas.io import failure, hang
from taas.io import keys as names
from taas.io.output import LineSplitter, OutputRouter
from taas.workdir import merge
from taas.job.api import Job
from taas.launch.api import RESULT, LaunchSpec, ProcessExit, ProcessSpec, attempt_id, error_name, fault_name
from taas.shield import deferred_interrupt

log = logging.getLogger(__name__)

STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when a job is stopped
STACK_WAIT = 2.0  # seconds to wait for the ranks' stacks (taas.launch.process.stacks) before going on
POLL = 0.05  # seconds per wait for events


class State(enum.Enum):
    PREPARING = "preparing"
    PREFETCHING = "prefetching"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed out"

    @property
    def final(self) -> bool:
        return self in (State.SUCCEEDED, State.FAILED, State.INTERRUPTED, State.TIMED_OUT)


class Ev(enum.Enum):
    STARTED = "started"
    LAUNCH_FAILED = "launch failed"
    LOADERS_READY = "loaders ready"
    ALL_EXITED = "all exited 0"
    FAILURE = "failure"
    TIMEOUT = "timeout"
    INTERRUPT = "interrupt"
    STOPPED = "stopped"
    RESTART = "restart"


S = State
_LIVE = (S.PREFETCHING, S.RUNNING)
_TABLE: dict[tuple[State, Ev], State] = {
    (S.PREPARING, Ev.STARTED): S.RUNNING,  # PREFETCHING when the job has loaders (Machine.on)
    (S.PREPARING, Ev.LAUNCH_FAILED): S.FAILED,
    (S.PREPARING, Ev.INTERRUPT): S.INTERRUPTED,
    (S.PREFETCHING, Ev.LOADERS_READY): S.RUNNING,
    (S.RUNNING, Ev.LOADERS_READY): S.RUNNING,  # a late progress event
    **{(s, Ev.ALL_EXITED): S.SUCCEEDED for s in _LIVE},
    **{(s, e): S.STOPPING for s in _LIVE for e in (Ev.FAILURE, Ev.TIMEOUT, Ev.INTERRUPT)},
    (S.STOPPING, Ev.FAILURE): S.STOPPING,  # peers failing after the first: same stop
    (S.STOPPING, Ev.INTERRUPT): S.STOPPING,  # the cause becomes the interrupt
    (S.STOPPING, Ev.STOPPED): S.FAILED,  # or RESTARTING / TIMED_OUT / INTERRUPTED (Machine.on)
    (S.RESTARTING, Ev.RESTART): S.PREPARING,
    (S.RESTARTING, Ev.INTERRUPT): S.INTERRUPTED,
}
_AFTER_STOP = {Ev.TIMEOUT: S.TIMED_OUT, Ev.INTERRUPT: S.INTERRUPTED}


class InvalidTransition(RuntimeError):
    pass


class Machine:
    """The states of one job (the module's diagram).  ``restarts``: attempts begun after the
    first; ``cause``: the event that made the current attempt stop."""

    def __init__(self, max_restarts: int = 0, has_loaders: bool = False):
        self.state = State.PREPARING
        self.max_restarts = max_restarts
        self.has_loaders = has_loaders
        self.restarts = 0
        self.cause: Ev | None = None
        self.history: list[State] = [self.state]

    def on(self, event: Ev) -> State:
        target = _TABLE.get((self.state, event))
        if target is None:
            raise InvalidTransition(f"{event.value!r} in state {self.state.value!r}")
        if target is S.RUNNING and self.state is S.PREPARING and self.has_loaders:
            target = S.PREFETCHING
        if target is S.STOPPING and (self.state is not S.STOPPING or event is Ev.INTERRUPT):
            self.cause = event
        if event is Ev.STOPPED:
            if self.cause is Ev.FAILURE and self.restarts < self.max_restarts:
                target = S.RESTARTING
            else:
                target = _AFTER_STOP.get(self.cause, S.FAILED)
        if event is Ev.RESTART:
            self.restarts += 1
            self.cause = None
        if target is not self.state:
            log.debug("job %s -> %s (%s)", self.state.value, target.value, event.value)
            self.history.append(target)
        self.state = target
        return target


@dataclass
class Outcome:
    """What a succeeded job left: rank 0's results (pickled, :data:`RESULT`), every process's
    exit code, and the figures the ranks reported."""

    result: bytes | None = None
    exit_codes: dict = field(default_factory=dict)
    comm_ops: dict = field(default_factory=dict)  # rank key -> operations on its groups
    restarts: int = 0


class Supervisor:
    def __init__(self, launcher, job: Job, sink, *, name_for=None, on_state=None):
        self.launcher = launcher
        self.job = job
        self.sink = sink
        self.name_for = name_for
        self.machine = Machine(job.policy.max_restarts, has_loaders=job.data is not None)
        self.on_state = on_state or (lambda state: None)  # the session's status line
        self.outcome = Outcome()
        self._stacks: dict[str, dict] = {}  # rank key -> its latest "stack" event
        self._done: set[str] = set()  # ranks that ran the cell to its end (a "done" event)
        self._up: set[str] = set()  # ranks that started (an "up" event): they answer stack requests
        self._up_at: float | None = None  # when the last of them did: --stall counts from there
        self._ranks: set[str] = set()

    def _on(self, event: Ev) -> State:
        state = self.machine.on(event)
        self.on_state(state)
        return state

    # ------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Run the job to its end: the outcome, or JobFailed / LaunchError / KeyboardInterrupt."""
        started = time.monotonic()
        while True:
            try:
                if self._attempt(started):
                    return self.outcome
            except KeyboardInterrupt:
                if not self.machine.state.final:
                    self._on(Ev.INTERRUPT)
                    if self.machine.state is S.STOPPING:
                        self._on(Ev.STOPPED)
                raise
            except BaseException:  # a loader that cannot be sent, no room for the files: re-raised
                if self.machine.state is S.PREPARING:
                    self._on(Ev.LAUNCH_FAILED)
                raise
            self._on(Ev.RESTART)
            self.outcome.restarts = self.machine.restarts

    def _attempt(self, started: float) -> bool:
        """One attempt: True when it succeeded, False when it failed and a restart follows;
        raises when the job ends failed."""
        job, plane, restart = self.job, self.job.data, self.machine.restarts
        handle = None
        self._done = set()
        self._up, self._up_at = set(), None  # ranks that answer "where are you?" (and since when)
        layers = merge.Layers(job.cwd, job.policy.storage == "layer"
                              and (job.world.size > 1 or plane is not None))
        try:
            spec = self._spec(restart)
            layers.mark()
            try:
                handle = self.launcher.start(spec)
            except LaunchError:
                self._on(Ev.LAUNCH_FAILED)
                raise
            log.debug("job %s attempt %d: started %s", job.job_id, restart, handle.keys)
            self._on(Ev.STARTED)
            show = job.policy.show
            router = OutputRouter(self.sink, handle.keys, set(show) if show is not None else None,
                                  tag=job.world.size > 1)
            ends = self._watch(handle, router, started)
            self.outcome.exit_codes = {k: e.returncode for k, e in ends.items()}
            if not any(end.failed for end in ends.values()):
                self._on(Ev.ALL_EXITED)
                if job.policy.results:
                    self.outcome.result = handle.fetch("rank0", RESULT)
                return True
            router.replay_hidden("--- recent output of {key} ---")
            failed = _job_failed(handle, list(ends.values()), self.name_for)
            if self._on(Ev.STOPPED) is S.RESTARTING:
                self.sink.write("stderr", f"taas: restart {restart + 1}/{job.policy.max_restarts}: "
                                f"{failed.summary}\n")
                return False
            if restart:
                summary = f"{failed.summary} (after {restart} restart{'s' * (restart != 1)})"
                rendered = [failed.rendered[0].replace(failed.summary, summary)] + failed.rendered[1:]
                failed = JobFailed(summary, rendered, failed.report)
            raise failed
        except JobFailed as exc:
            if plane is not None and self.machine.cause is Ev.TIMEOUT:
                reports = (lambda key: read_report(handle, key)) if handle is not None else None
                hung = plane.hang(job.policy.timeout, self.name_for, reports)
                if hung is not None:
                    raise hung from None
            raise exc
        finally:
            # A Ctrl-C here waits until the attempt is cleaned up (a second one cannot leave a
            # store, pipes or files behind), then is raised.
            with deferred_interrupt():
                if handle is not None:
                    handle.stop(STOP_GRACE)
                    layers.merge(handle.layers(), job.job_id, self.sink)  # failed attempts' files too
                    handle.close()
                if plane is not None:
                    plane.finish(self.sink)
                    plane.close()  # the transport's resources (shared memory)

    def _spec(self, restart: int) -> LaunchSpec:
        job, plane = self.job, self.job.data
        if plane is not None:
            plane.open(attempt_id(job.job_id, restart), job.transport)
        payload = dataclasses.replace(job.payload, loaders=plane.settings if plane is not None else {})
        processes = [ProcessSpec(key=names.rank_key(rank), entry="taas.rank.main:main", env=dict(job.env),
                                 storage="shared" if rank == 0 else job.policy.storage, rank=rank)
                     for rank in range(job.world.size)]
        if plane is not None:
            processes.extend(plane.processes(job.env, job.policy.storage))
        return LaunchSpec(
            job_id=job.job_id, cwd=job.cwd, processes=tuple(processes),
            files={"payload.pkl": pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)},
            shared_fds=job.shared_fds, device=job.world.device, restart=restart,
            max_restarts=job.policy.max_restarts,
            cleanups=job.cleanups + (tuple(plane.cleanups()) if plane is not None else ()),
        )

    # ------------------------------------------------------------------------------------
    def _watch(self, handle, router: OutputRouter, started: float) -> dict[str, failure.ProcessEnd]:
        """Pump output until every process ended; stop all at the first failure.

        Past ``--timeout`` and on Ctrl-C the ranks' places (:func:`places`) are taken before
        anything is stopped, and shown with the error; after ``--stall`` seconds without output
        from any process they are shown as one line, once per silence, and the job goes on."""
        job, plane, sink = self.job, self.job.data, self.sink
        timeout, stall = job.policy.timeout, job.policy.stall
        ends: dict[str, failure.ProcessEnd] = {}
        keys = handle.keys
        # Event lines can be larger than a pipe's buffer: reassemble them across reads.
        event_lines: dict[str, LineSplitter] = {}
        last_output = time.monotonic()
        stalled = False  # this silence was reported already

        def stopping() -> bool:
            return self.machine.state is S.STOPPING

        ranks = self._ranks = {k for k in keys if names.is_rank(k)}
        finishing = False  # every rank said "done": the rest of their exit is ours to cut short

        def deliver(events) -> None:
            nonlocal last_output, stalled
            for event in events:
                if isinstance(event, ProcessExit):
                    code = event.returncode
                    if finishing and (code < 0 or event.key not in ranks):
                        # Ended by us after the cell was done everywhere: a success (a loader
                        # worker stopped while it loaded a unit no rank will read, too).
                        code = 0
                    ends[event.key] = failure.ProcessEnd(event.key, code, time.time(), stopped=stopping())
                    log.debug("%s exited with %d", event.key, event.returncode)
                    if code != 0 and not stopping():
                        self._on(Ev.FAILURE)
                        handle.stop(STOP_GRACE)
                elif event.stream != "events":
                    last_output, stalled = time.monotonic(), False
                    router.feed(event.key, event.stream, event.data)
                else:
                    lines, _ = event_lines.setdefault(event.key, LineSplitter(max_line=None)).feed(event.data)
                    for line in lines:
                        self._on_event(event.key, line)

        def places() -> list[hang.Place]:
            """Where every rank is: the running ones are asked for their stacks (answers are
            awaited up to STACK_WAIT s, output keeps flowing meanwhile), the others ended."""
            ranks = [k for k in keys if names.is_rank(k)]
            self._stacks = {}
            asked = set(handle.request_stacks([k for k in ranks if k not in ends]))
            deadline = time.monotonic() + STACK_WAIT
            while asked - set(self._stacks) - set(ends) and time.monotonic() < deadline:
                deliver(handle.events(POLL))
            return [_place(k, self._stacks.get(k), ends.get(k), handle) for k in ranks]

        try:
            while len(ends) < len(keys):
                deliver(handle.events(POLL))
                router.tick()
                if not finishing and not stopping() and ranks <= self._done:
                    # Every rank ran the cell to its end and sent all it had (rank.py,
                    # _teardown): end the processes now rather than wait for their teardown.
                    finishing = True
                    log.debug("every rank is done: ending the job's processes")
                    handle.stop(STOP_GRACE)
                    continue
                if self._up_at is not None and last_output < self._up_at:
                    last_output = self._up_at  # silence counts once every rank is up
                if (stall and not stopping() and not stalled and len(ends) < len(keys)
                        and self._up_at is not None and time.monotonic() - last_output > stall):
                    stalled, since = True, last_output
                    where = places()
                    if not stopping() and last_output == since:  # still silent
                        router.tick()
                        sink.write("stderr", f"taas: no output for {stall:g} s; {hang.one_line(where)}\n")
                if timeout is not None and not stopping() and time.monotonic() - started > timeout:
                    where = places()  # before anything is stopped
                    if stopping() or len(ends) == len(keys):
                        continue  # a rank failed, or all ended, while they answered
                    self._on(Ev.TIMEOUT)
                    if plane is not None:
                        plane.note_timeout()  # who waited for which loader, before the stop
                    handle.stop(STOP_GRACE)
                    deliver(handle.drain())
                    router.close()
                    self._on(Ev.STOPPED)
                    left = failure.left_early(list(ends.values()))
                    odd = hang.odd_sentence(where)
                    why = (f" ({failure.left_line(left)})" if left is not None
                           else f" ({odd})" if odd else "")
                    summary = f"the job ran past --timeout {timeout:g}s{why}; all its processes were stopped"
                    raise JobFailed(summary, [failure.RED + failure.BOLD + summary + failure.RESET]
                                    + hang.render(where, self.name_for))
            deliver(handle.drain())
        except KeyboardInterrupt as exc:
            where = []
            if not stopping():
                try:
                    where = places()  # before anything is stopped
                except KeyboardInterrupt:
                    pass  # a second Ctrl-C: stop at once
            handle.stop(STOP_GRACE)
            router.close()
            if where:
                _explain_interrupt(exc, where, self.name_for)
            raise
        router.close()
        return ends

    def _on_event(self, key: str, line: str) -> None:
        """One JSON line from a process's events pipe (see taas.launch.process.events)."""
        try:
            message = json.loads(line)
        except ValueError:
            return
        kind = str(message.get("kind"))
        plane = self.job.data
        if kind == "display" and hasattr(self.sink, "display"):
            self.sink.display(message.get("data", {}), message.get("metadata", {}))
        elif kind == "stack":
            self._stacks[key] = message
        elif kind == "done":
            self._done.add(key)
        elif kind == "up":
            self._up.add(key)
            if self._up_at is None and all(k in self._up for k in self._ranks):
                self._up_at = time.monotonic()
        elif kind == "comm":
            self.outcome.comm_ops[key] = message.get("ops")
        elif kind.startswith("data.") and plane is not None:
            plane.on_event(key, message, self.sink)
            if self.machine.state is S.PREFETCHING and plane.ready():
                self._on(Ev.LOADERS_READY)


def read_report(handle, key: str) -> dict | None:
    """Process ``key``'s failure report (:mod:`taas.launch.process.report`), or None."""
    data = handle.fetch(key, error_name(key))
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def _job_failed(handle, ends: list, name_for) -> JobFailed:
    """The failure report: every process's error file and fault dump, the root cause first."""
    for end in ends:
        end.record = read_report(handle, end.key)
        end.fault = (handle.fetch(end.key, fault_name(end.key)) or b"").decode(errors="replace")
    root = failure.root_cause(ends)
    others = [end for end in ends if end is not root]
    return JobFailed(failure.summary(root), failure.render(root, others, name_for), root)


def _place(key: str, answer: dict | None, end, handle) -> hang.Place:
    """One rank's place: its answer, how it ended, or neither (it did not answer)."""
    if answer is not None:
        return hang.Place.from_event(key, answer)
    if end is None:
        return hang.Place(key)
    if end.returncode == 0:
        record = read_report(handle, key)
        return hang.Place(key, ended="already ended (sys.exit(0))" if record else "already ended (code 0)")
    return hang.Place(key, ended=f"already ended ({failure.describe_exit(end)})")


def _explain_interrupt(exc: KeyboardInterrupt, where: list, name_for) -> None:
    """Make the notebook show where the ranks were when the job was interrupted: IPython
    shows an exception's ``_render_traceback_`` instead of its frames (the error's name stays
    KeyboardInterrupt); plain Python shows the note."""
    lines = ["KeyboardInterrupt: the job was interrupted; all its processes were stopped"]
    lines += hang.render(where, name_for)
    exc._render_traceback_ = lambda: list(lines)
    exc.add_note("\n".join(lines[1:]))
