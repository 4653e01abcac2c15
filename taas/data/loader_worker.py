"""A loader worker: one process of a job that iterates a registered loader and sends units.

    unpickle the loader (cfg["loader"]) -> attach to the transport (cfg["address"])
    -> one sender per rank it feeds
    -> for its units (source.units): fetch, put (blocks while the channel is full)
    -> pass ends to every rank it feeds -> exit 0

Started by the same launcher as the ranks (``ProcessSpec(key="loader:NAME:w",
entry="taas.data.loader_worker:main", args=(settings,))``), so it dies with the job.  The loader's
exception is written as the process's error report (its traceback is what the notebook shows)
and the worker exits 1, which stops the job.  SIGTERM (the job is being stopped) raises
:class:`LoaderStopped` where the loader is, so a hung loader's report shows where it hung.
A watchdog thread ends the worker as soon as every rank it feeds has gone.  In a kept cell
(``TAAS_KEEP=1``) a worker that sent all its units waits for that too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

from taas.data import messages, source
from taas.data.plan import Plan
from taas.data.transport import BLOCKED, DONE, LOADING, attach
from taas.launch.process import report

PROGRESS_INTERVAL = 0.1


class LoaderStopped(Exception):
    """The job was stopped while this loader worker was running."""


def main(spec) -> int:
    cfg = spec.args[0]
    job_dir = os.environ["TAAS_JOB_DIR"]
    fault_file = open(report.fault_path(job_dir, spec.key), "w")
    faulthandler.enable(file=fault_file, all_threads=False)
    worker = cfg["worker"]
    state = {"unit": None}

    def on_term(signum, frame):
        unit = state["unit"]
        where = f"while loading unit {unit}" if unit is not None else "while waiting"
        raise LoaderStopped(f"loader `{cfg['name']}` worker {worker} was stopped {where}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return _run(cfg, state)
    except BaseException as exc:  # whatever the loader raised is this worker's reported failure
        report.write_error(job_dir, spec.key, exc, 1)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        faulthandler.disable()


def _run(cfg: dict, state: dict) -> int:
    import cloudpickle
    import torch

    torch.set_num_threads(1)
    name, worker = cfg["name"], cfg["worker"]
    plan = Plan(cfg["units"], cfg["workers"], cfg["ranks"], cfg["prefetch"])
    loader = cloudpickle.loads(cfg["loader"])
    endpoint = attach(cfg["address"])
    control = endpoint.worker(worker)
    progress = _Progress(control, name, worker, plan.prefetch_of(worker))

    def on_wait(waiting: bool) -> None:
        if waiting:
            control.set_state(BLOCKED, state["unit"] or 0)
            progress.ready()  # a full buffer is as ready as it gets
        else:
            control.set_state(LOADING, state["unit"] or 0)

    senders = {rank: endpoint.sender(plan.channel(worker, rank), on_wait) for rank in plan.ranks_of(worker)}
    _watchdog(senders)

    def on_fetch(unit: int) -> None:
        state["unit"] = unit
        control.set_state(LOADING, unit)

    def skip(unit: int) -> bool:
        return senders[unit % plan.ranks].gone

    drafts = {}

    def alloc_for(unit: int):
        draft = drafts[unit] = senders[unit % plan.ranks].draft()
        return draft.alloc if draft is not None else None

    produced = 0
    units = source.units(loader, worker, plan.workers, plan.units, cfg["seed"], skip, on_fetch, alloc_for)
    for kind, a, b in units:
        if kind == source.UNIT:
            if senders[a % plan.ranks].put(a, b, drafts.pop(a, None)):
                produced += 1
                progress.produced(produced)
            state["unit"] = None
        else:
            for sender in senders.values():
                sender.end_pass(a, b)
        if all(sender.gone for sender in senders.values()):
            break
    control.set_state(DONE)
    progress.done(produced)
    if os.environ.get("TAAS_KEEP") == "1":
        # A kept cell's loader workers are a job of their own, whose clean-up hooks (this
        # loader's shared memory unlinked) run once all its processes ended: stay until the
        # ranks closed their views, which they may not even have opened yet.
        while not all(sender.gone for sender in senders.values()):
            time.sleep(0.05)
    return 0


class _Progress:
    """Status in the transport's control state (what ranks poll) and throttled events (what
    the notebook shows)."""

    def __init__(self, control, name: str, worker: int, prefetch: int):
        self.control, self.name, self.worker, self.prefetch = control, name, worker, prefetch
        self.count = 0
        self.sent_at = 0.0
        self.is_ready = False
        if prefetch == 0:
            self.ready()

    def produced(self, count: int) -> None:
        self.count = count
        self.control.produced(count)
        if count >= self.prefetch and not self.is_ready:
            self.ready()
        elif time.monotonic() - self.sent_at >= PROGRESS_INTERVAL:
            self._send()

    def ready(self) -> None:
        if not self.is_ready:
            self.is_ready = True
            self.control.prefetched()
            self._send()

    def done(self, count: int) -> None:
        self.count = count
        self.control.produced(count)
        self.ready()
        self._send(done=True)

    def _send(self, done: bool = False) -> None:
        self.sent_at = time.monotonic()
        messages.send(messages.Progress(loader=self.name, worker=self.worker, produced=self.count,
                                        ready=self.is_ready, done=done))


def _watchdog(senders: dict) -> None:
    """End this process once every rank it feeds has gone: nobody needs its units, and a
    loader stuck in a slow fetch must not keep the job alive."""

    def watch() -> None:
        while True:
            time.sleep(0.1)
            if all(sender.gone for sender in senders.values()):
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(0)

    threading.Thread(target=watch, name="taas-loader-watchdog", daemon=True).start()
