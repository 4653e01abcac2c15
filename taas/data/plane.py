"""The kernel side of the data plane, one per job that reads registered loaders.

    DataPlane.plan(values, options, world, device)   before packaging: which registered loaders
        the cell reads (taken out of ``values``: the loader goes to loader workers, the ranks get
        a view), K, prefetch; a loader without len() and no --units is a DirectiveError
    .open(job_id, transport)      loader pickles; the job's transport (the launcher's choice,
                                  :mod:`taas.data.transport`) makes each loader's channels
    .settings                     name -> what a rank's view needs (Payload.loaders)
    .processes(env)               the loader workers' ProcessSpecs (``loader:NAME:w``), each
                                  carrying its loader's pickle
    .cleanups()                   the transport's cleanup hooks (LaunchSpec.cleanups)
    .on_event(key, message, sink) workers' progress -> an in-place "units ready / K" line;
                                  ranks' figures -> the summary (messages.py: typed; a line
                                  it cannot read is logged and ignored)
    .summary()                    one line per loader after the job
    .fail(key, line)              a loader worker failed: ranks reading it raise it (kept ranks)
    .note_timeout(), .hang(...)   at --timeout: was a loader worker the culprit?
    .close()                      the transport releases everything of the job
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from taas.data import messages, registry
from taas.data import plan as numbering
from taas.data.transport import LOADING, Transport, resolve
from taas.errors import JobFailed, PackagingError
from taas.io import keys
from taas.launch.api import ProcessSpec

log = logging.getLogger("taas")

DEFAULT_BUFFER_MB = 256
PROGRESS_INTERVAL = 0.1


@dataclass
class _Loader:
    name: str
    names: list
    entry: registry.Entry
    length: int | None = None
    plan: numbering.Plan | None = None
    cfg: dict = field(default_factory=dict)
    produced: dict = field(default_factory=dict)  # worker -> units produced
    ready: set = field(default_factory=set)  # workers with their first slice ready
    ready_at: float | None = None
    stats: dict = field(default_factory=dict)  # rank -> figures it reported (messages.Stats)
    prefetch_s: float = 0.0  # how long the ranks waited for the first slice
    shown_at: float = 0.0


class DataPlane:
    def __init__(self, loaders: list[_Loader], world: int, device: str):
        self.loaders = loaders
        self.world = world
        self.device = device
        self.job_id: str | None = None
        self.transport: Transport | None = None
        self.settings: dict[str, dict] = {}
        self.seed = 0  # the units' shuffle (plan() draws it from the kernel's torch RNG)
        self.opened = 0  # attempts opened so far (a restart's seed is derived from the first)

    # -- before launch ---------------------------------------------------------------------
    @classmethod
    def plan(cls, values: dict, options, world: int, device: str) -> "DataPlane | None":
        """Take the registered loaders out of ``values``; None if the cell reads none."""
        found: dict[int, _Loader] = {}
        for name in list(values):
            entry = registry.entry(values[name])
            if entry is None:
                continue
            item = found.setdefault(id(entry.loader), _Loader(name, [], entry))
            item.names.append(name)
            del values[name]
        for name, loader in _read_by_functions(values):
            item = found.setdefault(id(loader), _Loader(name, [], registry.entry(loader)))
            if name not in item.names:
                item.names.append(name)
        if not found:
            return None
        for item in found.values():
            item.length = _len(item.entry.loader)
            units = numbering.resolve_units(options.units, item.length, item.name)
            prefetch = numbering.default_prefetch(units, world, options.cpus, item.entry.prefetch)
            item.plan = numbering.Plan(units, options.cpus, world, prefetch)
        plane = cls(list(found.values()), world, device)
        # Like a DataLoader's iter(): one draw from the kernel's torch RNG, so that a fixed
        # torch.manual_seed gives the same units to the same ranks, run after run -- drawn here,
        # in the kernel, wherever the job then runs (taas.host.serve).
        import torch

        plane.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return plane

    def stand_ins(self) -> dict[int, str]:
        """The registered loaders as objects that must not travel to ranks (see package.ship)."""
        return {id(item.entry.loader): item.name for item in self.loaders}

    def open(self, job_id: str, transport: "type[Transport] | str") -> None:
        """Make every loader's channels with ``transport`` (a :class:`Transport` class, or its
        ``"module:Class"`` name) and the settings its workers and ranks attach with."""
        from taas.job import crossing

        if isinstance(transport, str):
            transport = resolve(transport)
        self.job_id = job_id
        self.settings = {}
        self._timeout_snapshot = None
        for item in self.loaders:  # a restarted job starts its figures afresh
            item.produced, item.ready, item.stats = {}, set(), {}
            item.ready_at, item.prefetch_s, item.shown_at = None, 0.0, 0.0
        self.transport = transport(job_id)
        # The seed drawn when the plane was planned; each restart's its own, as fixed.
        seed = self.seed if not self.opened else numbering.mix(self.seed, self.opened)
        self.opened += 1
        for index, item in enumerate(self.loaders):
            try:
                blob = crossing.dumps(item.entry.loader, crossing.TO_RANK)  # keeps cell file names
            except Exception as exc:  # any pickling failure becomes the one-line PackagingError
                raise PackagingError(f"cannot send registered loader `{item.name}` to loader workers: "
                                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            plan = item.plan
            buffer_mb = item.entry.buffer_mb or DEFAULT_BUFFER_MB
            address = self.transport.channels(index, plan.workers, plan.pairs(), int(buffer_mb * 2**20))
            loader = item.entry.loader
            common = dict(name=item.name, units=plan.units, workers=plan.workers, ranks=plan.ranks,
                          prefetch=plan.prefetch, address=address)
            item.cfg = dict(common, loader=blob, seed=seed)
            self.settings[item.name] = dict(
                common, names=list(item.names), length=item.length,
                batch_size=getattr(loader, "batch_size", None),
                dataset_len=_len(getattr(loader, "dataset", None)),
                dataset_type=type(getattr(loader, "dataset", loader)).__name__,
                device=self.device,  # a CUDA rank's view pins its batches (view.pinning_for)
            )

    def cleanups(self) -> tuple:
        """Hooks that free the job's data-plane resources from another process (the launcher
        runs them when the job is over or the kernel died): ``LaunchSpec.cleanups``."""
        return (self.transport.cleanup(),) if self.transport is not None else ()

    def processes(self, env: dict, storage: str = "strict") -> list[ProcessSpec]:
        out = []
        for item in self.loaders:
            for worker in range(item.plan.workers):
                out.append(ProcessSpec(
                    key=keys.loader_key(item.name, worker), role=keys.LOADER,
                    entry="taas.data.loader_worker:main",
                    env=dict(env, OMP_NUM_THREADS="1"), storage=storage,
                    args=(dict(item.cfg, worker=worker),),
                ))
        if self.transport is not None:
            out.extend(self.transport.processes(dict(env)))  # e.g. the TCP transport's relays
        return out

    # -- while it runs ---------------------------------------------------------------------
    def on_event(self, key: str, message: dict, sink) -> None:
        """A ``data.*`` event line from job process ``key``, decoded; one that is not a
        data-plane message (:func:`taas.data.messages.parse`), or names a loader, worker or
        rank this job does not have, is logged and ignored: the job goes on."""
        event = messages.parse(message)
        if event is None:
            return
        item = next((i for i in self.loaders if i.name == event.loader), None)
        if item is None:
            return  # a loader of no job of ours (kept ranks may outlive a plane)
        if isinstance(event, messages.Progress):
            if event.worker >= item.plan.workers:
                log.warning("taas data plane: ignored progress of %s for worker %d of loader `%s`, "
                            "which has %d", key, event.worker, item.name, item.plan.workers)
                return
            item.produced[event.worker] = event.produced
            if event.ready:
                item.ready.add(event.worker)
            self._show(item, sink)
        elif isinstance(event, messages.Started):
            item.prefetch_s = max(item.prefetch_s, event.prefetch_s)
        elif event.rank < self.world:
            item.stats[event.rank] = event
        else:
            log.warning("taas data plane: ignored figures of %s for rank %d of a %d-rank job",
                        key, event.rank, self.world)

    def _show(self, item: _Loader, sink, final: bool = False) -> None:
        if item.ready_at is not None:
            return  # already settled
        now = time.monotonic()
        done = len(item.ready) >= item.plan.workers
        if not (done or final) and now - item.shown_at < PROGRESS_INTERVAL:
            return
        from taas.io.progress import prefetch_line

        item.shown_at = now
        text = prefetch_line(item.name, sum(item.produced.values()), item.plan.units, started=done)
        if done:
            item.ready_at = now
        if hasattr(sink, "progress"):
            sink.progress(f"data:{item.name}", "stderr", text, final=done or final)

    def finish(self, sink) -> None:
        """Settle progress lines still open (a job that ended during prefetch)."""
        for item in self.loaders:
            if item.ready_at is None and item.shown_at:
                self._show(item, sink, final=True)
                item.ready_at = time.monotonic()

    def figures(self) -> list[tuple[dict, float]]:
        """What the run told each loader (its ranks' figures, the prefetch wait): all that
        :meth:`summary` reads, for a plane that ran in another process (taas.host.serve)."""
        return [(dict(item.stats), item.prefetch_s) for item in self.loaders]

    def take_figures(self, figures: list[tuple[dict, float]]) -> None:
        """This plane's loaders told what :meth:`figures` of the plane that ran said."""
        for item, (stats, prefetch_s) in zip(self.loaders, figures):
            item.stats, item.prefetch_s = stats, prefetch_s

    def summary(self) -> list[str]:
        lines = []
        for item in self.loaders:
            if not item.stats:
                continue
            stats = item.stats.values()
            units = sum(s.units for s in stats)
            moved = _size(sum(s.bytes for s in stats))
            elapsed = sum(s.elapsed_s for s in stats)
            waited = sum(s.wait_s for s in stats) / elapsed if elapsed > 0 else 0.0
            plan = item.plan
            lines.append(
                f"taas: loader `{item.name}`: {units}/{plan.units} units delivered to "
                f"{plan.ranks} rank{'s' * (plan.ranks != 1)} by {plan.workers} "
                f"worker{'s' * (plan.workers != 1)}, {moved} moved; after {item.prefetch_s:.2f} s "
                f"of prefetch, ranks waited for data {waited:.1%} of the time")
        return lines

    # -- failure ---------------------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """What every loader worker is doing now, and which ranks wait for its units."""
        out = []
        if self.transport is None:
            return out
        for index, item in enumerate(self.loaders):
            if not item.cfg:
                continue  # open() failed before this loader's channels were made
            plan = item.plan
            control = self.transport.control(index)
            pairs = plan.pairs()
            waiting = {}  # worker -> (rank, unit, seconds) of the longest wait on it
            for channel, (unit, waited) in control.wanted.items():
                worker, rank = pairs[channel]
                if worker not in waiting or waited > waiting[worker][2]:
                    waiting[worker] = (rank, unit, waited)
            for worker, status in enumerate(control.workers):
                out.append(dict(
                    loader=item.name, worker=worker, state=status.state, unit=status.unit,
                    busy=status.busy_s, prefetched=status.prefetched, waiting=waiting.get(worker),
                ))
        return out

    def fail(self, key: str, line: str) -> bool:
        """Job process ``key`` failed with ``line`` (its one-line summary): if it is a loader
        worker of this plane, the ranks reading that loader raise it in their cell
        (:meth:`Transport.fail`; kept ranks are not stopped for it).  Whether it was one."""
        for index, item in enumerate(self.loaders):
            for worker in range(item.plan.workers if item.cfg else 0):
                if keys.loader_key(item.name, worker) == key and self.transport is not None:
                    self.transport.fail(index, worker, line)
                    return True
        return False

    def note_timeout(self) -> None:
        """The job hit --timeout: remember what the loader workers were doing, before the stop."""
        self._timeout_snapshot = self.snapshot()

    def ready(self) -> bool:
        """Every loader's first slice is ready (the ranks run)."""
        return all(item.ready_at is not None for item in self.loaders)

    def hang(self, timeout: float | None, name_for=None, read_report=None) -> JobFailed | None:
        """After --timeout: a loader worker still loading a unit that a rank waits for (or, before
        the ranks could start, one of the first slice) is the culprit -- say so, with the worker's
        stack when it was stopped (``read_report(key)``: its error report, or None)."""
        from taas.io import failure

        snapshot = getattr(self, "_timeout_snapshot", None)
        if not snapshot or timeout is None:
            return None
        loading = [s for s in snapshot if s["state"] == LOADING]
        stuck = [s for s in loading if s["waiting"]] or [s for s in loading if not s["prefetched"]]
        if not stuck:
            return None
        s = max(stuck, key=lambda s: s["busy"])
        key = f"loader:{s['loader']}:{s['worker']}"
        message = (f"the job ran past --timeout {timeout:g}s: loader `{s['loader']}` worker "
                   f"{s['worker']} ({key}) spent {s['busy']:.1f} s loading unit {s['unit']}")
        if s["waiting"]:
            rank, unit, waited = s["waiting"]
            message += f" while rank{rank} waited {waited:.1f} s for unit {unit}"
        else:
            message += ", before the ranks could start (the first slice was not ready)"
        end = failure.ProcessEnd(key, 1, time.time(), record=read_report(key) if read_report else None)
        lines = failure.render(end, [], name_for)
        return JobFailed(message, [f"{failure.RED}{failure.BOLD}{message}{failure.RESET}"] + lines[1:], end)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _read_by_functions(values: dict) -> list[tuple[str, object]]:
    """Registered loaders that notebook functions and classes among ``values`` read as
    globals (transitively): the ranks' shared globals get views under those names too."""
    from taas.job.package import _referenced_globals

    out, seen, stack = [], set(), list(values.values())
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for name, ref in _referenced_globals(value).items():
            if registry.entry(ref) is not None:
                out.append((name, ref))
            else:
                stack.append(ref)
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _len(obj) -> int | None:
    if obj is None:
        return None
    try:
        return len(obj)
    except Exception:  # a user __len__ may raise anything: treated as "no length"
        return None
