"""One kernel's taas, the composition root: where a cell runs, the Job it becomes, its run.
No IPython here.

    where     launcher_for(): this machine's launcher, or a Ray cluster's
              transport_for(launcher.topology()): the data plane's transport (shm or TCP)
    cell      options ──resolve──> World (ranks, device, backend)          Session._job
              cell ──analyse──> free names ──select+ship──> Payload       (fails before launch)
              registered loaders the cell reads ──> DataPlane
    run       Job ──> Supervisor(launcher).run()                           Session._run
              (taas.supervisor.supervisor: states, output, failure, restarts)
    results   rank 0's result.pkl ──taas.job.results──> names, Out[] and notes for the notebook

What has a job of its own lives in its own room: the result format (:mod:`taas.job.results`,
which also defines :class:`CellResult`), the rendering of a cell's syntax error
(:func:`taas.io.failure.syntax_error`), the working-directory check
(:func:`taas.workdir.cwd.working_directory`, re-exported here), and what every job of a cell
goes through around its run (:mod:`taas.cellrun`: the cell read, the live plot, the notes, settling).

The magics layer (:mod:`taas.magics`) is a thin adapter over :meth:`Session.run_cell`; tests
and scripts call it directly with a plain dict as the namespace.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING

from taas import cellrun, directive
from taas.errors import DirectiveError, KeptRanksGone, LaunchError
from taas.io import keys
from taas.io.output import INFO, WARN, Recording, Sink, TerminalSink
from taas.io.output import note as write_note
from taas.job import package, results
from taas.job import metrics as job_metrics  # noqa: F401 - also how taas.log / taas.metrics reach it (taas/__init__.py)
from taas.job.api import Job, JobStats, Policy, World
from taas.job.memory.bigvalues import BigValues
from taas.job.memory.resident import ResidentMemory
from taas.job.results import CellResult
from taas.keptrun import KeptRanks
from taas.launch.api import cuda_device_count
from taas.leases import inventory
from taas.leases.locks import Lease
from taas.leases.wait import for_cell, machine_lines
from taas.shield import deferred_interrupt
from taas.supervisor.kept import Kept, Keeper
from taas.supervisor.supervisor import Supervisor
from taas.wiring import group_timeout, launcher_from_env, process_env, rebound_loaders, transport_for
from taas.workdir.cwd import working_directory

if TYPE_CHECKING:  # the data plane is imported only when a cell reads a registered loader
    from taas.data.plane import DataPlane

# Re-exported: tests and scripts reach these through the session.
_rebound_loaders = rebound_loaders
__all__ = ["INFO", "WARN", "CellResult", "JobStats", "Session", "launcher_from_env",
           "transport_for", "working_directory", "write_note"]

log = logging.getLogger(__name__)


class Session(KeptRanks):
    def __init__(self, launcher=None):
        self.launcher = launcher or launcher_from_env()  # this machine's
        # ``%taas cluster ADDRESS``: the session's default cluster ("local": this machine, even
        # with RAY_ADDRESS set); None: $RAY_ADDRESS, else this machine.
        self.cluster: str | None = None
        self._cluster_launcher = None  # the RayLauncher of the cluster used last
        # ``%taas cluster ... --workdir MODE --workdir-limit SIZE``: how the notebook's working
        # directory reaches cluster nodes (taas.workdir.sync); None limit: the default.
        self.workdir = "auto"
        self.workdir_limit: int | None = None
        self.last: JobStats | None = None
        self._debugging = False  # %taas debug runs its cell (it keeps _failed_rank)
        # Big tensor storages moved to shared memory in place, for every later job to map
        # (taas.job.memory.resident); their files are closed once the notebook frees them.
        self.resident = ResidentMemory()
        self.job_ids: list[str] = []  # every job this session ran, oldest first
        # One job at a time per kernel (a cell may run one from a thread): the launcher's
        # channel to the start process is not shared.
        self._running = threading.Lock()
        self._running_since: str | None = None
        # --keep: the ranks kept between cells (taas.supervisor.kept), and why the last kept
        # ranks ended while no cell ran (the idle limit): the next cell says so.
        self.keeper = Keeper(self._running)
        self._shipped: dict = {}  # what the cell being prepared sends to kept ranks
        # The device decision taas made for the last job with --device auto, as the fallback
        # note states it (directive.note_fact; None: CUDA): the note shows when this changes.
        self._device_fact: str | None = None
        # Told each state the supervisor enters (taas.supervisor.machine.State): a job host
        # (taas.host) says "running" to its viewers when the ranks run.
        self.on_state = None
        # The GPUs ranks here may use (tests give fake ones); the running job's lease (this
        # process's copy: its processes hold theirs, so it lives as long as they do).
        self.gpus = inventory.gpus
        self._lease: Lease | None = None
        self.job_name: str | None = None  # what leases name the job by (a job host: its record's id)
        # Where this machine's jobs run: None, here (a job host's own Session); in a kernel, the
        # kernel's job host (taas.host.remote.KernelHost): its ``supervisor(...)`` runs the job
        # in the host child, so that the ranks are the host's and the kernel only views them.
        self.job_host = None

    def warm(self) -> None:
        (self.job_host or self.launcher).warm()

    @staticmethod
    def preload_for_fork() -> None:
        """Import what this machine's start process imports, without initialising CUDA, and
        what a job's preparation imports (the data plane, planned for every job): a job host
        forked from this process (taas.host.zygote) then prepares its job and forks its start
        process warm."""
        import taas.data.plane  # noqa: F401  (what _job imports at the first job)
        from taas.launch.local import forkstart

        forkstart.preload()

    def close(self) -> None:
        self.keeper.let_go()  # ours end; adopted ones (a detached job's) wait for the next kernel
        if self._cluster_launcher is not None:
            self._cluster_launcher.shutdown()
            self._cluster_launcher = None
        if self.job_host is not None:
            self.job_host.close()
        self.launcher.shutdown()
        self.resident.close()

    def after_cell(self, *args) -> None:
        """After every notebook cell: let go of the shared files of tensors it freed, so that
        their memory is returned now, not at the next job."""
        try:
            self.resident.prune()
        except OSError:  # /proc unreadable: kept until the next job, nothing lost
            pass

    # -- where jobs run -----------------------------------------------------------------
    def cluster_address(self, options: directive.JobOptions | None = None) -> str | None:
        """The Ray cluster a cell runs on: its ``--cluster``, else the session's
        (``%taas cluster``), else ``$RAY_ADDRESS``; None (or ``local``) is this machine."""
        for address in (options.cluster if options else None, self.cluster,
                        os.environ.get("RAY_ADDRESS")):
            if address:
                return None if address == "local" else address
        return None

    def launcher_for(self, address: str | None):
        """This machine's launcher, or the Ray launcher of ``address`` (one cluster at a time:
        a Ray driver connects to one; switching ends the previous connection and its agents)."""
        if address is None:
            return self.launcher
        current = self._cluster_launcher
        if current is None or current.address != address:
            from taas.launch.ray.launcher import RayLauncher

            if current is not None:
                current.shutdown()
            self._cluster_launcher = RayLauncher(address)
        self._cluster_launcher.workdir = self.workdir
        self._cluster_launcher.workdir_limit = self.workdir_limit
        return self._cluster_launcher

    def use_cluster(self, address: str | None, workdir: str | None = None,
                    workdir_limit: int | None = None) -> list[str]:
        """``%taas cluster ADDRESS|local``: the session's default from now on; connects at once
        (so a wrong address shows now; ``local`` ends a cluster connection) and returns the
        lines that describe it.  ``workdir``
        (auto, shared, copy) and ``workdir_limit`` (bytes), when given, say how the notebook's
        working directory reaches the nodes from now on."""
        self.cluster = address or "local"
        if workdir is not None:
            self.workdir = workdir
        if workdir_limit is not None:
            self.workdir_limit = workdir_limit
        target = self.cluster_address()
        lines = []
        kept = self.keeper.kept
        if kept is not None and kept.launcher is self._cluster_launcher and (
                target is None or target != kept.launcher.address):  # kept on the cluster we leave
            lines.append(f"{self.keeper.release()}: the session now runs cells elsewhere")
        if target is None and self._cluster_launcher is not None:
            # Back to this machine: end the cluster connection, so its agents, the GPUs they
            # keep reserved for a warm next cell, and the working directory's copies go now.
            self._cluster_launcher.shutdown()
            self._cluster_launcher = None
        return lines + self.launcher_for(target).describe()

    # ------------------------------------------------------------------------------------
    def run_cell(self, source: str, namespace: dict, options: directive.JobOptions, **kwargs) -> CellResult:
        """Run ``source`` as a job (see :meth:`_run_cell`); a second job while one runs in this
        kernel is refused at once."""
        # The idle limit's timer may be ending kept ranks right now: that is no job, wait for it.
        wait = 15 if self.keeper.releasing else 0
        if not (self._running.acquire(timeout=wait) if wait else self._running.acquire(blocking=False)):
            raise self._busy()
        try:
            self._running_since = time.strftime("%H:%M:%S")
            return self._run_cell(source, namespace, options, **kwargs)
        finally:
            try:
                self.resident.settle()  # big tensors moved during the job: done before user code runs
            finally:
                with deferred_interrupt():  # a Ctrl-C here must not keep the lock: no cell would run again
                    self._let_go()  # the ranks' own copies (kept ones) still hold the GPUs
                    self._running.release()

    def _run_cell(self, source: str, namespace: dict, options: directive.JobOptions, *,
                  filename: str = "<taas cell>", first_line: int = 1, sink: Sink | None = None,
                  hidden: frozenset = frozenset(), name_for=None, text: str | None = None,
                  post_mortem: bool = False) -> CellResult:
        """Where the cell runs, the Job it becomes (:meth:`_job`), then that job's run
        (:meth:`_run`).  ``text``: the cell as typed when ``source`` is IPython's translation
        of its syntax (taas.job.syntax), for tracebacks.  ``post_mortem`` (IPython's ``%pdb on``):
        a failing rank opens the debugger where it raised, before the job ends (taas.rank.console)."""
        sink = sink or TerminalSink()
        cwd = working_directory()  # before anything else: even importing torch needs it
        address = self.cluster_address(options)
        kept = self.keeper.kept
        if kept is not None and kept.launcher is self._cluster_launcher and address != kept.launcher.address:
            # Kept ranks on a cluster this cell leaves: ended (one line) before launcher_for
            # may end that cluster's connection under them.
            self.keeper.reuse(None, None, options.fresh, None, sink)
        launcher = self.launcher_for(address)
        cuda_devices = functools.cache(launcher.cuda_devices)  # once a cell: a cluster asks its nodes
        kept = self._kept_for(launcher, options, sink, cuda_devices)
        keep = kept is not None or options.keep is not None
        if keep and not launcher.keeps_ranks:
            raise DirectiveError(
                "--keep is not supported on a cluster yet" if launcher is not self.launcher
                else "--keep is not supported by this launcher")
        if kept is not None and options.gpus is None:  # no --gpus: the kept world
            options = dataclasses.replace(options, gpus=kept.world.size)
        job, plane, big = self._job(launcher, cwd, source, filename, first_line, namespace,
                                    options, sink, hidden, name_for, kept=kept, keep=keep, text=text,
                                    post_mortem=post_mortem, cuda_devices=cuda_devices())
        try:
            self.last = JobStats(job.job_id, job.world.size, job.world.device, job.world.backend,
                                 loaders=sorted(i.name for i in plane.loaders) if plane else [],
                                 config=options.config, cluster=address)
            if not keep:
                return self._run(launcher, job, plane, big, self.last, sink, name_for)
            try:
                return self._run_kept(launcher, job, big, options, sink, name_for)
            except KeptRanksGone as gone:  # a rank ended since the check above: nothing was sent
                if kept is None:
                    raise
                was = kept.world
                sink.write("stderr", f"taas: released the kept ranks ({was.size} on {was.device}/"
                           f"{was.backend}): {gone.reason}, so their state is lost; this cell starts "
                           "fresh ranks\n")
            return self._run_cell(source, namespace, options, filename=filename, first_line=first_line,
                                  sink=sink, hidden=hidden, name_for=name_for, text=text, post_mortem=post_mortem)
        finally:  # what the run's own clean-up did not get to (a Ctrl-C before it began): its files
            big.unlink(wait=False)  # and results channel (a no-op after it, or once kept ranks own it)

    def detached_job(self, source: str, namespace: dict, options: directive.JobOptions, *, job_name: str,
                     hand_over, filename: str = "<taas cell>", first_line: int = 1, sink: Sink | None = None,
                     hidden: frozenset = frozenset(), name_for=None, text: str | None = None, launcher=None,
                     cuda_devices: int | None = None):
        """``--detach`` here: the cell made into a Job as an attached cell's is (GPUs leased for
        ``job_name``; rank 0's results inline; ``--keep``: the first cell of kept ranks, which
        a kernel adopts later), then what ``hand_over(job, lines, seen)`` says:
        it gives the job, its files and its record's first ``lines`` (the first ``seen`` shown
        by the cell) to a job host, whose launcher removes the big values' files at the end
        (if it raised, they go now).  ``launcher``: where the ranks run (default this
        machine's; a Ray cluster's: its host actor gets the job).  ``cuda_devices``: the
        launcher's count, when someone asked already (a cluster's host actor: the kernel then
        starts no node agents of its own)."""
        launcher = launcher or self.launcher
        if cuda_devices is None:
            cuda_devices = launcher.cuda_devices()
        if not self._running.acquire(blocking=False):
            raise self._busy()
        self._running_since = time.strftime("%H:%M:%S")
        name, self.job_name = self.job_name, job_name
        big, shown = None, Recording(sink or TerminalSink())
        try:
            job, _, big = self._job(launcher, working_directory(), source, filename, first_line, namespace,
                                    options, shown, hidden, name_for, keep=options.keep is not None, text=text,
                                    cuda_devices=cuda_devices, channel=False)
            # Its record starts with the notes the cell showed, then the device's if the cell
            # did not (a viewer elsewhere never saw this kernel's earlier cells).
            seen = len(shown.lines)
            note = directive.resolve_world(options, cuda_devices, launcher.where)[3]
            if note and not any(note in line for _, line in shown.lines):
                shown.lines.append((INFO, f"{note}\n"))
            said = hand_over(job, tuple(shown.lines), seen)
            big.paths = []  # the host's now (its launcher's cleanups remove them)
            return said
        finally:
            with deferred_interrupt():  # whole: a Ctrl-C here must not keep the lock (no cell would run)
                self.job_name = name
                if big is not None:
                    big.unlink(wait=False)
                self.resident.settle()
                self._let_go()  # our copies of the lease: the host's keep the GPUs
                self._running.release()

    def _busy(self) -> LaunchError:
        return LaunchError(f"a taas job is already running in this kernel (started at {self._running_since}); "
                           "wait for it to finish or interrupt it, then run this cell again")

    def _job(self, launcher, cwd: str, source: str, filename: str, first_line: int, namespace: dict,
             options: directive.JobOptions, sink: Sink, hidden: frozenset,
             name_for, kept: Kept | None = None, keep: bool = False,
             text: str | None = None, post_mortem: bool = False,
             cuda_devices: int | None = None, channel: bool = True) -> tuple[Job, DataPlane | None, BigValues]:
        """The cell as a Job, its data plane (``job.data``, typed) and the BigValues its big
        arrays went out through (the caller closes them).  Everything that can fail before
        launch fails here: a syntax error, a value that cannot be shipped, more processes than
        the launcher has room for.  ``cuda_devices``: the launcher's count, if asked already."""
        # Long on purpose: every check that can refuse the cell runs here, in order, before
        # anything is written or started.
        if cuda_devices is None:
            cuda_devices = launcher.cuda_devices()  # the GPUs the ranks can use, where they run
        local_cuda = cuda_devices if launcher is self.launcher else cuda_device_count()
        world, device, backend, note = directive.resolve_world(options, cuda_devices, launcher.where)
        cell, values = cellrun.read_cell(source, namespace, filename, first_line, hidden, name_for)
        if kept is not None:  # kept ranks: only what they lack or the notebook changed
            values = {k: v for k, v in values.items() if not kept.holds(k, v)}
        rebound = rebound_loaders(namespace, values)
        # Registered loaders the cell reads leave ``values`` (loader workers get them; the ranks get
        # views): their DataPlane (on kept ranks: this cell's loader job), or None.
        from taas.data.plane import DataPlane

        plane = DataPlane.plan(values, options, world, device)
        workers = sum(i.plan.workers for i in plane.loaders) if plane is not None else 0
        if kept is None:  # before anything is written or started
            launcher.check(world + workers, device, ranks=world)
        elif workers:  # kept ranks run already: only this cell's loader workers start
            launcher.check(workers, device, ranks=0)
        job_id = uuid.uuid4().hex[:12]
        lease = None
        if launcher is self.launcher and device == "cuda" and kept is None:  # kept ranks hold theirs
            self._let_go()  # this machine's GPUs for fresh ranks, leased: may wait in line
            lease = self._lease = for_cell(world, self.job_name or job_id, self.gpus, sink,
                                           no_wait=options.no_wait)
        self.job_ids.append(job_id)
        # Large arrays travel once, through shared memory; on a cluster only by descriptor
        # (the launcher sends those bytes to each node), as named files stay on this machine.
        self.resident.prune()
        # Kept ranks started before this cell cannot receive descriptors: big values go as files.
        big = BigValues(job_id, resident=None if kept is not None else self.resident,
                        files=launcher is self.launcher)
        try:
            blob = package.ship(values, plane.stand_ins() if plane is not None else None, big)
            # Rank 0's big results come back as memory files on a channel, on this machine only.
            # Kept ranks already have theirs (their first cell's, taas.supervisor.kept.Kept.channel).
            returning = big.open_results_channel() if options.results and big.files and kept is None and channel else {}
            if launcher is not self.launcher:
                self.resident.settle()  # a cluster launcher reads the files' bytes to send them
            if self._device_changed(options, note) and note:
                write_note(sink, note, INFO)
            for line in rebound + big.notes:
                write_note(sink, line, WARN)
            log.debug("job %s: %d ranks on %s (%s), %d names shipped (%d bytes), %d loader workers",
                      job_id, world, device, backend, len(values), len(blob), workers)
            if keep:
                log.debug("kept ranks: shipped %s", ", ".join(sorted(values)) or "nothing")
                self._shipped = values
            return Job(
                job_id=job_id, cwd=cwd,
                payload=package.Payload(
                    source=source, filename=filename, first_line=first_line, names=blob,
                    bound=cell.bound, device=device, backend=backend,
                    pg_timeout=group_timeout(options.timeout), results=options.results,
                    results_to_cpu=results.results_to_cpu(options.results_device, local_cuda),
                    text=text if text != source else None, post_mortem=post_mortem),
                world=World(world, device, backend),
                policy=Policy(timeout=options.timeout, max_restarts=options.max_restarts,
                              stall=options.stall, storage=options.storage,
                              show=None if options.show is None else frozenset(keys.rank_key(r) for r in options.show),
                              results=options.results),
                data=plane, transport=transport_for(launcher.topology(world)) if plane is not None else None,
                env=dict(process_env(world) | returning | (lease.env() if lease else {}),
                         **({"TAAS_KEEP": "1"} if keep else {})),
                # resident big tensors, results channel; the GPU lease's files: every process holds it
                shared_fds=tuple(big.fds) + (lease.fds if lease else ()),
                cleanups=tuple(big.cleanups()),
            ), plane, big
        except BaseException:  # a value that could not ship, a Ctrl-C: its files and channel go now
            big.unlink(wait=False)
            raise

    def gpu_lines(self) -> list[str]:
        """``%taas``: this machine's GPUs, free, leased (by which job) or busy outside taas."""
        return machine_lines(self.gpus())

    def _let_go(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()

    def _run(self, launcher, job: Job, plane: DataPlane | None, big: BigValues, stats: JobStats,
             sink: Sink, name_for) -> CellResult:
        """``job`` through the supervisor; rank 0's results for the notebook.  ``stats`` follows
        the supervisor's states and gets the job's figures however it ends."""
        plot, on_metrics = cellrun.live_plot(job, sink)
        make = self.job_host.supervisor if self.job_host is not None and launcher is self.launcher else Supervisor
        supervisor = make(launcher, job, sink, name_for=name_for, on_state=lambda state: self._state(stats, state),
                          on_metrics=on_metrics)
        started = time.monotonic()
        try:
            outcome = supervisor.run()
            cellrun.succeeded(job, outcome, plane, stats, sink)
            if not job.policy.results or outcome.result is None:
                return CellResult()  # rank 0 ended early (sys.exit(0)): nothing to bring back
            back = results.load(results.decode(outcome.result), big.channel)
            stats.results = back.big
            return back
        finally:
            cellrun.settle(plot, big, stats, started, supervisor.outcome)
            stats.restarts = supervisor.outcome.restarts

    def _state(self, stats: JobStats, state) -> None:
        stats.outcome = state.value
        if self.on_state is not None:
            self.on_state(state)

    def _device_changed(self, options: directive.JobOptions, note: str | None) -> bool:
        """Whether the device decision of a job with ``options`` (its fallback ``note``, None on
        CUDA) differs from the last one taas made: the CPU-fallback note shows once per kernel,
        and again only when the decision changes.  A chosen ``--device`` decides nothing."""
        if options.device != "auto":
            return False
        fact = directive.note_fact(note) if note else None
        changed, self._device_fact = fact != self._device_fact, fact
        return changed

