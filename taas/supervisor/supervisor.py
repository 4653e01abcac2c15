"""The supervisor: runs one :class:`~taas.job.api.Job` on a launcher, through its states.

The states and their transitions are :mod:`taas.supervisor.machine` (the table); where the
ranks are and why a job failed, :mod:`taas.supervisor.diagnosis`; what the processes say on
their events pipes, :mod:`taas.supervisor.events`.  Here, the run over attempts: per attempt
:class:`Supervisor` opens the data plane, builds the :class:`LaunchSpec`, starts it, watches it
(:class:`Watch`: output pumped to the router until every process ended, everything stopped at
the first failure), merges the ranks' layers and brings back rank 0's results -- all through
the launcher's :class:`~taas.launch.api.JobHandle`.

Policy: ``--timeout`` bounds the whole job (restarts included) and is not restarted; a failed
attempt starts again from scratch (fresh processes, each registered loader's units delivered
again, exactly once per attempt, as a restarted torchrun job re-creates its DataLoaders) with
``TORCHELASTIC_RESTART_COUNT`` one higher.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from dataclasses import dataclass, field

from taas.errors import JobFailed, LaunchError
from taas.io import failure
from taas.io.board import Board
from taas.io import keys as names
from taas.io.output import WARN, LineSplitter, OutputRouter, note
from taas.job.api import PAYLOAD, Job
from taas.launch.api import RESULT, LaunchSpec, ProcessExit, ProcessSpec, attempt_id
from taas.shield import checkpoint, deferred_interrupt
from taas.supervisor import diagnosis, events, prompts
from taas.supervisor.machine import Ev, InvalidTransition, Machine, State  # noqa: F401 (re-exported)
from taas.workdir import merge

log = logging.getLogger(__name__)

STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when a job is stopped
POLL = 0.05  # seconds per wait for events
S = State


@dataclass
class Outcome:
    """What a succeeded job left: rank 0's results (pickled, :data:`RESULT`), every process's
    exit code, and the figures the ranks reported."""

    result: bytes | None = None
    exit_codes: dict = field(default_factory=dict)
    comm_ops: dict = field(default_factory=dict)  # rank key -> operations on its groups
    trained: dict = field(default_factory=dict)  # rank key -> {"backward": n, "steps": m}
    restarts: int = 0


class Supervisor:
    """Runs one job to its end (:meth:`run`), attempt after attempt, on ``launcher``; output,
    displays and progress go to ``sink``; ``name_for`` names the cell's file in tracebacks;
    ``on_state`` hears every state the job enters; ``on_metrics(key, rows)`` every batch of rows a
    rank's ``taas.log`` sent (events.Metrics)."""

    def __init__(self, launcher, job: Job, sink, *, name_for=None, on_state=None, on_metrics=None):
        self.launcher = launcher
        self.job = job
        self.sink = sink
        self.name_for = name_for
        self.machine = Machine(job.policy.max_restarts, has_loaders=job.data is not None)
        self.on_state = on_state or (lambda state: None)  # the session's status line
        self.on_metrics = on_metrics or (lambda key, rows: None)  # the session's history and plot
        self.outcome = Outcome()

    def transition(self, event: Ev) -> State:
        """Move the job through its states (and tell the session)."""
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
                    self.transition(Ev.INTERRUPT)
                    if self.machine.state is S.STOPPING:
                        self.transition(Ev.STOPPED)
                raise
            except BaseException:  # a loader that cannot be sent, no room for the files: re-raised
                if self.machine.state is S.PREPARING:
                    self.transition(Ev.LAUNCH_FAILED)
                raise
            self.transition(Ev.RESTART)
            self.outcome.restarts = self.machine.restarts

    def _attempt(self, started: float) -> bool:
        """One attempt: True when it succeeded, False when it failed and a restart follows;
        raises when the job ends failed."""
        # Long on purpose: start, watch and stop of one attempt under one try/finally, so that
        # the attempt's processes, layers and data plane are closed on every way out.
        job, plane, restart = self.job, self.job.data, self.machine.restarts
        handle = None
        succeeded = False
        missed = False  # interrupted, past --timeout, or failed on a missing file (unseen_hint)
        layers = merge.Layers(job.cwd, job.policy.storage == "layer"
                              and (job.world.size > 1 or plane is not None))
        try:
            spec = self._spec(restart)
            layers.mark()
            try:
                handle = self.launcher.start(spec)
            except LaunchError:
                self.transition(Ev.LAUNCH_FAILED)
                raise
            log.debug("job %s attempt %d: started %s", job.job_id, restart, handle.keys)
            self.transition(Ev.STARTED)
            show = job.policy.show
            router = OutputRouter(self.sink, handle.keys, set(show) if show is not None else None,
                                  tag=job.world.size > 1)
            ends = Watch(self, handle, router, started).run()
            self.outcome.exit_codes = {k: e.returncode for k, e in ends.items()}
            if not any(end.failed for end in ends.values()):
                self.transition(Ev.ALL_EXITED)
                if job.policy.results:
                    self.outcome.result = handle.fetch("rank0", RESULT)
                succeeded = True
                return True
            router.replay_hidden("--- recent output of {key} ---")
            failed = diagnosis.job_failed(handle, list(ends.values()), self.name_for)
            missed = diagnosis.missing_file(failed)
            if self.transition(Ev.STOPPED) is S.RESTARTING:
                note(self.sink, f"taas: restart {restart + 1}/{job.policy.max_restarts}: "
                     f"{failed.summary}", WARN)
                return False
            if restart:
                summary = f"{failed.summary} (after {restart} restart{'s' * (restart != 1)})"
                rendered = [failed.rendered[0].replace(failed.summary, summary)] + failed.rendered[1:]
                failed = JobFailed(summary, rendered, failed.report)
            raise failed
        except KeyboardInterrupt:
            missed = True
            raise
        except JobFailed:
            missed = missed or self.machine.cause is Ev.TIMEOUT
            if plane is not None and self.machine.cause is Ev.TIMEOUT:
                reports = (lambda key: diagnosis.read_report(handle, key)) if handle is not None else None
                hung = plane.hang(job.policy.timeout, self.name_for, reports)
                if hung is not None:
                    raise hung from None
            raise
        finally:
            # A Ctrl-C here waits until the attempt is cleaned up (a second one cannot leave a
            # store, pipes or files behind), then is raised.
            with deferred_interrupt():
                if handle is not None:
                    handle.stop(STOP_GRACE)
                    # What rank 0 or the notebook wrote meanwhile, before the merge adds files.
                    written = layers.written() if missed and job.world.size > 1 else []
                    merged = layers.merge(handle.layers(), job.job_id, self.sink)  # failed attempts' too
                    hint = None if succeeded else diagnosis.layer_hint(merged)
                    # Why ranks that read each other's files, or waited for a file, failed.
                    for line in (hint, failure.unseen_hint(written)):
                        if line:
                            note(self.sink, line, WARN)
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
            files={PAYLOAD: pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)},
            shared_fds=job.shared_fds, device=job.world.device, restart=restart,
            max_restarts=job.policy.max_restarts,
            cleanups=job.cleanups + (tuple(plane.cleanups()) if plane is not None else ()),
        )


class Watch:
    """One attempt's processes, watched to their end (:meth:`run`): their output pumped to the
    router, their events read, every process stopped at the first failure.

    Past ``--timeout`` and on Ctrl-C the ranks' places (:func:`diagnosis.places`) are taken
    before anything is stopped, and shown with the error; after ``--stall`` seconds without
    output from any process they are shown as one line, once per silence, and the job goes on."""

    def __init__(self, supervisor: Supervisor, handle, router: OutputRouter, started: float):
        self.supervisor, self.job, self.sink = supervisor, supervisor.job, supervisor.sink
        self.handle, self.router, self.started = handle, router, started
        self.keys = list(handle.keys)
        self.ranks = [k for k in self.keys if names.is_rank(k)]
        self.ends: dict[str, failure.ProcessEnd] = {}
        # Event lines can be larger than a pipe's buffer: reassemble them across reads.
        self.lines: dict[str, LineSplitter] = {}
        self.stacks: dict[str, events.Stack] = {}  # rank key -> its latest answer to "where are you?"
        self.done: set[str] = set()  # ranks that ran the cell to its end (a "done" event)
        self.gpu_mem: dict[str, int] = {}  # kept ranks: GPU bytes each holds as it said done
        self.up: set[str] = set()  # ranks that started (an "up" event): they answer stack requests
        self.up_at: float | None = None  # when the last of them did: --stall counts from there
        self.last_output = time.monotonic()
        self.stalled = False  # this silence was reported already
        self.finishing = False  # every rank said "done": the rest of their exit is ours to cut short
        self.board = Board(self.sink, self.keys)  # the live rank panel (taas.io.board)
        # Ranks' questions for the notebook's input box (input(), pdb), served one at a time
        # in the order they came (taas.supervisor.prompts), and the ranks in the debugger now.
        self.prompts = prompts.Prompts(self.sink, handle, self.board)

    @property
    def stopping(self) -> bool:
        return self.supervisor.machine.state is S.STOPPING

    def run(self) -> dict[str, failure.ProcessEnd]:
        """Every process's end; raises JobFailed past --timeout, KeyboardInterrupt on Ctrl-C."""
        try:
            while len(self.ends) < len(self.keys):
                self.deliver(self.handle.events(POLL))
                checkpoint()  # an interrupt of a job run in a thread of its own (taas.shield)
                self.router.tick()
                self.board.tick()
                self.serve_prompts()
                if self._finish():
                    continue
                self._check_stall()
                self._check_timeout()
            self.deliver(self.handle.drain())
        except KeyboardInterrupt as exc:
            self._interrupted(exc)
            raise
        finally:
            self.board.close()  # the panel gives way to its summary line, however the attempt ends
        self.router.close()
        return self.ends

    def deliver(self, items) -> None:
        for item in items:
            if isinstance(item, ProcessExit):
                self._exited(item)
            elif item.stream != "events":
                self.last_output, self.stalled = time.monotonic(), False
                self.board.output(item.key)
                self.router.feed(item.key, item.stream, item.data)
            else:
                splitter = self.lines.setdefault(item.key, LineSplitter(max_line=None))
                for line in splitter.feed(item.data)[0]:
                    message = events.parse(item.key, line)
                    if message is not None:
                        self._on_message(item.key, message)

    def serve_prompts(self) -> None:
        """Answer the ranks' questions waiting (one after another), output shown first; the
        silence spent at a prompt is no stall.  KeyboardInterrupt at the prompt propagates."""
        if not self.prompts.waiting or self.stopping:
            return
        # What the asking rank printed before it asked (pdb's listing) is on another pipe:
        # read what has come, and show it, before the input box.
        self.deliver(self.handle.events(0))
        self.router.flush()
        self.prompts.serve(lambda key: key in self.ends)
        self.last_output, self.stalled = time.monotonic(), False

    def places(self):
        return diagnosis.places(self.handle, self.ranks, self.ends, self.stacks,
                                lambda: self.deliver(self.handle.events(POLL)))

    # -- what happens ---------------------------------------------------------------------------
    def _exited(self, event: ProcessExit) -> None:
        code = event.returncode
        if self.finishing and (code < 0 or event.key not in self.ranks):
            # Ended by us after the cell was done everywhere: a success (a loader worker
            # stopped while it loaded a unit no rank will read, too).
            code = 0
        self.ends[event.key] = failure.ProcessEnd(event.key, code, time.time(), stopped=self.stopping)
        self.board.exited(event.key, code, stopped=self.stopping)
        self.prompts.left(event.key)
        log.debug("%s exited with %d", event.key, event.returncode)
        if code != 0 and not self.stopping:
            self.supervisor.transition(Ev.FAILURE)
            self.handle.stop(STOP_GRACE)

    def _on_message(self, key: str, message: events.Message) -> None:
        """One message from a process's events pipe (already checked: see :mod:`.events`)."""
        if isinstance(message, events.Display):
            self._display(key, message)
        elif isinstance(message, events.Stack):
            self.stacks[key] = message
        elif isinstance(message, events.Beat):
            self.board.beat(key, message)
            self.prompts.beat(key, message.state)
        elif isinstance(message, events.Ask):
            self.prompts.asked(key, message)
        elif isinstance(message, events.Done):
            self.done.add(key)
            self.prompts.left(key)
            if message.gpu_mem is not None:
                self.gpu_mem[key] = message.gpu_mem
            self.board.done(key)
        elif isinstance(message, events.Up):
            self.up.add(key)
            if self.up_at is None and all(k in self.up for k in self.ranks):
                self.up_at = time.monotonic()
        elif isinstance(message, events.Comm):
            self.supervisor.outcome.comm_ops[key] = message.ops
            self.supervisor.outcome.trained[key] = {"backward": message.backward, "steps": message.steps}
        elif isinstance(message, events.DataFigure):
            self._data_figure(key, message)
        elif isinstance(message, events.Metrics):
            self.supervisor.on_metrics(key, message.rows)

    def _display(self, key: str, message: events.Display) -> None:
        if not hasattr(self.sink, "display"):
            return
        try:
            self.sink.display(message.data, message.metadata)
        except (TypeError, ValueError) as exc:  # the notebook refused the bundle: a bad message
            log.warning("ignored a display from %s the notebook cannot show: %s", key, exc)

    def _data_figure(self, key: str, message: events.DataFigure) -> None:
        if message.kind == "data.progress":  # checked by events.parse: worker and produced are ints
            self.board.loader(key, message.message["produced"], message.message.get("done") is True)
        plane = self.job.data
        if plane is None:
            return
        try:
            plane.on_event(key, dict(message.message), self.sink)
        except (KeyError, TypeError, ValueError) as exc:  # a figure the plane cannot use informs nothing
            log.warning("ignored a data-plane figure from %s: %r", key, exc)
            return
        if self.supervisor.machine.state is S.PREFETCHING and plane.ready():
            self.supervisor.transition(Ev.LOADERS_READY)

    def _finish(self) -> bool:
        """Every rank ran the cell to its end and sent all it had (rank/main.py, _teardown):
        end the processes now rather than wait for their teardown.  True when it just did."""
        if self.finishing or self.stopping or not set(self.ranks) <= self.done:
            return False
        self.finishing = True
        log.debug("every rank is done: ending the job's processes")
        self.handle.stop(STOP_GRACE)
        return True

    def _check_stall(self) -> None:
        if self.up_at is None:
            return  # silence counts once every rank is up
        self.last_output = max(self.last_output, self.up_at)
        stall = self.job.policy.stall
        if self.prompts.debugging:  # a rank in the debugger (or at input()) is no hang
            self.last_output, self.stalled = time.monotonic(), False
            return
        if (not stall or self.stopping or self.stalled or len(self.ends) == len(self.keys)
                or time.monotonic() - self.last_output <= stall):
            return
        self.stalled, since = True, self.last_output
        where = self.places()
        if not self.stopping and self.last_output == since:  # still silent
            self.router.tick()
            note(self.sink, diagnosis.stall_line(stall, where), WARN)

    def _check_timeout(self) -> None:
        timeout = self.job.policy.timeout
        if timeout is None or self.stopping or time.monotonic() - self.started <= timeout:
            return
        where = self.places()  # before anything is stopped
        if self.stopping or len(self.ends) == len(self.keys):
            return  # a rank failed, or all ended, while they answered
        self.supervisor.transition(Ev.TIMEOUT)
        if self.job.data is not None:
            self.job.data.note_timeout()  # who waited for which loader, before the stop
        self.handle.stop(STOP_GRACE)
        self.deliver(self.handle.drain())
        self.router.close()
        self.supervisor.transition(Ev.STOPPED)
        raise diagnosis.timed_out(timeout, list(self.ends.values()), where, self.supervisor.name_for)

    def _interrupted(self, exc: KeyboardInterrupt) -> None:
        where = []
        if not self.stopping:
            try:
                where = self.places()  # before anything is stopped
            except KeyboardInterrupt:
                pass  # a second Ctrl-C: stop at once
        self.handle.stop(STOP_GRACE)
        self.router.close()
        if where:
            diagnosis.explain_interrupt(exc, where, self.supervisor.name_for)
