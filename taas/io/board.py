"""The live rank panel while a job runs: what each process is doing, and when the cell shows it.

The supervisor feeds a :class:`Board` what it hears (a process's output, a rank's ``beat``,
``done``, an exit, a loader worker's progress) and calls :meth:`Board.tick` in its loop; the
board turns that into rows (:mod:`taas.io.panel`) and shows them:

* where the sink updates a display in place (``sink.updates_in_place``: a notebook front end
  such as JupyterLab), from :data:`DELAY` seconds into the job, one block refreshed every
  :data:`EVERY` second (``sink.panel(bundle, metadata, final)``), which gives way to the one-line
  summary when the job ends;
* in a terminal (a sink without ``panel``: terminal IPython, plain Python) as text written to
  stderr, first after :data:`TEXT_DELAY` seconds and at most every :data:`TEXT_EVERY`;
* in a notebook run by a batch runner (a sink with ``panel`` that does not update in place:
  nbconvert, nbclient, nbval, papermill keep a display's last state and save the cell's
  outputs) as text too, but only when no process printed anything for :data:`SAVED_SILENCE`
  seconds, and at most that often: a saved notebook of a job that keeps printing (every
  example under ``examples/``, compared by nbval) stays as it was, while one that goes quiet
  says where its ranks are.

Nothing at all for jobs shorter than those delays.

Pure logic over a sink and a clock (both injectable): tests drive it as data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from taas.io import keys as names
from taas.io import panel

DELAY = 2.0  # seconds into a job before a live panel appears (short cells never get one)
EVERY = 1.0  # seconds between refreshes of a live panel
TEXT_DELAY = 10.0  # seconds into a job before the panel is printed as text
TEXT_EVERY = 10.0  # seconds between two printed panels
SAVED_SILENCE = 30.0  # seconds without output before a batch-run notebook gets a printed panel
METADATA = {"taas": {"panel": True}}  # marks the panel's display among the cell's outputs


@dataclass
class _Rank:
    state: str = "starting"
    node: int | None = None
    line: int | None = None
    call: str = ""
    output_at: float | None = None
    cpu: float | None = None
    rss: int | None = None
    gpu_mem: int | None = None
    gpu_util: int | None = None
    running_at: float | None = None  # when its cell started (its first beat past "starting")
    data: dict = field(default_factory=dict)  # loader -> (units taken, seconds waited)


@dataclass
class _Worker:
    state: str = "loading"
    units: int = 0


class Board:
    """One attempt's panel: its processes' figures (fed by the supervisor) and its display."""

    def __init__(self, sink, keys, *, clock=time.monotonic, delay: float = DELAY,
                 every: float = EVERY, text_delay: float = TEXT_DELAY, text_every: float = TEXT_EVERY,
                 saved_silence: float = SAVED_SILENCE):
        self.sink, self.clock = sink, clock
        notebook = callable(getattr(sink, "panel", None))
        self.live = notebook and bool(getattr(sink, "updates_in_place", False))
        self.saved = notebook and not self.live  # a batch runner saves what the cell shows
        if self.live:
            self.delay, self.every = delay, every
        else:
            self.delay, self.every = (saved_silence, saved_silence) if self.saved else (text_delay, text_every)
        self.started = clock()
        self.output_at = self.started  # any process's latest output (a batch run's silence)
        self.shown_at: float | None = None  # when it was last shown (None: never)
        self.ranks = {k: _Rank() for k in sorted(keys, key=names.order) if names.is_rank(k)}
        self.workers = {k: _Worker() for k in sorted(keys, key=names.order)
                        if k.startswith("loader:")}  # io/keys.py's loader keys

    # -- what the supervisor hears --------------------------------------------------------------
    def output(self, key: str) -> None:
        self.output_at = self.clock()
        rank = self.ranks.get(key)
        if rank is not None:
            rank.output_at = self.output_at

    def beat(self, key: str, beat) -> None:
        """A rank's ``beat`` (:class:`taas.supervisor.events.Beat`, read by its fields)."""
        rank = self.ranks.get(key)
        if rank is None or rank.state in ("done", "failed", "stopped"):
            return  # a late beat never brings a finished rank back
        rank.state, rank.node, rank.line, rank.call = beat.state, beat.node, beat.line, beat.call
        rank.cpu, rank.rss, rank.gpu_mem, rank.gpu_util = beat.cpu, beat.rss, beat.gpu_mem, beat.gpu_util
        if rank.running_at is None and beat.state != "starting":
            rank.running_at = self.clock()
        rank.data = {name: (units, wait) for name, units, wait in beat.data}

    def asking(self, key: str, debugger: bool) -> None:
        """Rank ``key`` waits at a prompt: in the debugger (pdb), or at ``input()``; shown now,
        before its next beat says so."""
        rank = self.ranks.get(key)
        if rank is not None and rank.state not in ("done", "failed", "stopped"):
            rank.state = "debugger" if debugger else "input"

    def done(self, key: str) -> None:
        if key in self.ranks:
            self.ranks[key].state = "done"

    def exited(self, key: str, code: int, stopped: bool = False) -> None:
        """Process ``key`` ended with ``code``; ``stopped``: taas stopped it."""
        entry = self.ranks.get(key) or self.workers.get(key)
        if entry is None:
            return
        if code == 0:
            entry.state = "done"
        elif entry.state != "done":
            entry.state = "stopped" if stopped else "failed"

    def loader(self, key: str, produced: int, finished: bool = False) -> None:
        """A loader worker's progress (its ``data.progress`` figure)."""
        worker = self.workers.get(key)
        if worker is not None:
            worker.units = produced
            if finished:
                worker.state = "done"

    # -- what the cell shows ---------------------------------------------------------------------
    def tick(self) -> None:
        """Show the panel if it is due."""
        now = self.clock()
        if now - (self.output_at if self.saved else self.started) < self.delay:
            return
        if self.shown_at is not None and now - self.shown_at < self.every:
            return
        self.shown_at = now
        title, ranks, loaders = self._title(now), self.rank_rows(now), self.loader_rows(now)
        if self.live:
            self.sink.panel({"text/plain": panel.text(title, ranks, loaders),
                             "text/html": panel.as_html(title, ranks, loaders)}, METADATA, final=False)
        else:
            self.sink.write("stderr", panel.text(title, ranks, loaders))

    def close(self) -> None:
        """The attempt is over: a live panel gives way to its one-line summary (a printed one
        stays as it is; a job too short for a panel never gets one)."""
        if self.live and self.shown_at is not None:
            now = self.clock()
            line = panel.summary(len(self.ranks), now - self.started, self.rank_rows(now))
            self.sink.panel({"text/plain": line}, METADATA, final=True)
            self.shown_at = None

    # -- rows ------------------------------------------------------------------------------------
    def rank_rows(self, now: float) -> list[panel.RankRow]:
        finished = ("done", "failed", "stopped")
        return [panel.RankRow(
            key=key, state=r.state, node=r.node, line=None if r.state in finished else r.line,
            call="" if r.state in finished else r.call,
            quiet=None if r.output_at is None else now - r.output_at,
            cpu=r.cpu, rss=r.rss, gpu_mem=r.gpu_mem, gpu_util=r.gpu_util)
            for key, r in self.ranks.items()]

    def loader_rows(self, now: float) -> list[panel.LoaderRow]:
        return [panel.LoaderRow(key, w.state, w.units, self.data_wait(key[len("loader:"):].rsplit(":", 1)[0], now))
                for key, w in self.workers.items()]

    def data_wait(self, loader: str, now: float) -> float | None:
        """The share of the ranks' time (since their cells started) spent waiting for
        ``loader``'s units; None before any rank said."""
        waited = elapsed = 0.0
        for r in self.ranks.values():
            if loader in r.data and r.running_at is not None:
                waited += r.data[loader][1]
                elapsed += now - r.running_at
        return min(1.0, waited / elapsed) if elapsed > 0 else None

    def _title(self, now: float) -> str:
        world = len(self.ranks)
        return f"taas: {world} rank{'s' * (world != 1)}, {panel.seconds(now - self.started)} into the job"
