"""The viewer's side of a job host: start a detached job, follow it, take its results, cancel it.

A kernel (:mod:`taas.magics`) and a terminal (:mod:`taas.cli`) use the same calls; neither
reads the host's memory or talks to it but through its record folder and, to cancel, a signal
to the pid the record names (checked against that process's start time).

    start(...)    a job the kernel prepared, handed to a job host (spares.py),
                  its output shown until the ranks run; the record
    follow(...)   the output so far (its latest records, what is shown in place at its latest
                  state), then live, until the job ends or the viewer is interrupted
    take(...)     rank 0's names and Out[] of a finished job, once
    cancel(...)   SIGTERM to the host: every process stopped within seconds
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import signal
import time
from collections.abc import Callable

import psutil

from taas.errors import JobFailed, LaunchError, RenderedError
from taas.host.api import FAILURE, Failure, Prepared, Returned
from taas.host.spares import Hosts
from taas.job import crossing
from taas.jobs import api as records
from taas.jobs.api import JobRecord, State
from taas.jobs.log import LogReader, read_view
from taas.jobs.store import JobError, Store, hold_lock, new_id, write_file
from taas.jobs.watch import Changes

POLL = 0.02  # how often a follower looks at the record and its log (s) without inotify
LOOK = 0.5  # with inotify (jobs/watch.py): woken by each change, it still looks this often (a lost host)
LATEST = 64 << 10  # how much of the latest output (bytes of text) an attach shows before going live
CANCEL_GRACE = 5.0  # the host stops every process within this; then SIGKILL (its guard ends the rest)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def first_code_line(source: str) -> str:
    for line in source.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()[:80]
    return ""


def running_copy(store: Store, source: str, notebook: str) -> JobRecord | None:
    """This notebook's still-running job of the very same cell, or None."""
    digest = source_hash(source)
    for item in store.listing(prune=False):
        record = item.record
        if (not record.state.final and record.source_hash == digest and record.notebook == notebook
                and not item.problem):
            return record
    return None


def start(store: Store, work: Prepared, *, ranks: int, where: str, notebook: str, sink,
          hosts=None, hashed: str | None = None, job_id: str | None = None, skip: int = 0) -> JobRecord:
    """Start ``work`` under a job host (``hosts``' warm spare, else a new one) and show its
    output until the ranks run; its record then.  ``work``: a job the kernel prepared (its
    shared files go to the host with it).  A job that
    ends before (a launch error, a failure in the first seconds) raises what an attached cell
    would; an interrupt meanwhile cancels it.  ``hashed``: the text that identifies the cell
    (its options and body; default: the body), for :func:`running_copy`; ``job_id``: the
    record's id (default: a fresh one, :func:`fresh_id`); ``skip``: how many of its first
    output records ``sink`` showed already."""
    hosts = hosts or Hosts()
    job = work.job
    text, cwd, fds = job.payload.text or job.payload.source, job.cwd, list(job.shared_fds)
    # As it is, but code keeps its file names (the cells' own, for tracebacks).
    data = crossing.dumps(dataclasses.replace(work, job=dataclasses.replace(job, shared_fds=())), crossing.AS_IS)
    record = JobRecord(id=job_id or fresh_id(store), state=State.WAITING, ranks=ranks, where=where,
                       started=time.time(), notebook=notebook, first_line=first_code_line(text),
                       source_hash=source_hash(hashed or text), cwd=cwd)
    folder = store.create(record)
    write_file(folder / records.PREPARED, data)
    host = hosts.take(store, ranks)
    lock = hold_lock(folder)  # held for the host from now on: the record never reads lost meanwhile
    try:
        host.give(folder, lock, fds)
    except OSError as exc:
        raise LaunchError(f"taas: could not hand job {record.id} to a job host: {exc}") from None
    finally:
        os.close(lock)
    follower = Follower(store, record.id, sink, skip=skip)
    try:
        while True:
            follower.step()
            said = host.wait(POLL)
            if said is not None:
                break
        record = store.read(record.id)
    except KeyboardInterrupt:
        host.close()
        cancel(store, record.id)
        raise
    finally:
        host.close()
        hosts.prewarm(store, record.ranks or None, later=True)
    if record.state is State.WAITING:  # the host ended before it wrote a word
        raise LaunchError(f"taas: the host of job {record.id} could not start: "
                          f"{_tail(folder / 'host.log')}")
    if record.state.final:
        follower.finish()
        raise_failure(store, record)
    return record


def fresh_id(store: Store) -> str:
    """A job id no record of ``store`` has."""
    taken = set(store.ids())
    while True:
        job_id = new_id()
        if job_id not in taken:
            return job_id


def _tail(path: pathlib.Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


class Follower:
    """Shows a job's record on ``sink`` (a notebook's, or a terminal's) as the job writes it."""

    def __init__(self, store: Store, job_id: str, sink, *, latest: int | None = None,
                 on_metrics: Callable | None = None, skip: int = 0):
        self.store = store
        self.skip = skip  # the first output records, which the sink has shown already
        self.job_id = job_id
        self.sink = sink
        # Where the job's output is read (its source): this machine's record folder, or what
        # the store offers instead (a Ray cluster's key-value store: taas.host.ray.store) as
        # ``log_reader(job_id, part)`` and ``read_view(job_id)``, readers with LogReader's calls.
        if hasattr(store, "log_reader"):
            self.reader = store.log_reader(job_id, records.OUT)
            self.metrics = store.log_reader(job_id, records.METRICS)
            self._view = lambda: store.read_view(job_id)
        else:
            folder = store.folder(job_id)
            self.reader = LogReader(folder)
            self.metrics = LogReader(folder, part=records.METRICS)
            self._view = lambda: read_view(folder)
        self.on_metrics = on_metrics
        # The latest ``latest`` bytes of output only, then live: an attach shows where the job
        # is at once, whatever it printed before, and holds no more of the log than that.
        self.budget = latest
        # The log's bytes are the text's in JSON records: read some more of them, show ``latest``.
        if latest is not None and self.reader.start_at_latest_bytes(4 * latest + 4096):
            sink.write("stdout", f"taas: job {job_id}: earlier output not shown here "
                       f"(`taas logs {job_id}` prints it all)\n")
        self._view_at = None
        self._shown: dict = {"progress": {}, "panel": None, "live": {}}
        # What ended in the log, and at which record: a view saved before that (its ``n`` not
        # past the record) still shows it open, and must not open it again.
        self._ended: dict = {}

    def step(self) -> None:
        items = self.reader.read(with_index=True)
        if self.budget is not None:
            items, self.budget = _latest(items, self.budget), None
        if self.skip:
            items, self.skip = items[self.skip:], max(0, self.skip - len(items))
        for item in items:
            self._show(item)
        if self.on_metrics is not None:
            for item in self.metrics.read():
                if item.get("op") == "m":
                    self.on_metrics(self.job_id, item["r"], [(step, values) for step, values in item["rows"]])
        view = self._view()
        if view and view.get("at") != self._view_at:
            self._view_at = view.get("at")
            self._update(view)

    def _show(self, item: dict) -> None:
        op, sink = item.get("op"), self.sink
        if op == "w":
            sink.write(item["s"], item["x"])
        elif op == "p":
            self._shown["progress"].pop(f"{item['k']}\n{item['s']}", None)
            self._ended[("progress", f"{item['k']}\n{item['s']}")] = item.get("i", 0)
            if hasattr(sink, "progress"):
                sink.progress(item["k"], item["s"], item["x"], True)
        elif op == "d" and hasattr(sink, "display"):
            sink.display(item["data"], item["md"])
        elif op == "l" and hasattr(sink, "live"):
            self._shown["live"].pop(item["n"], None)
            self._ended[("live", item["n"])] = item.get("i", 0)
            sink.live(item["n"], item["data"], item["md"], True)
        elif op == "P":
            self._ended[("panel", "")] = item.get("i", 0)
            if hasattr(sink, "panel"):
                sink.panel(item["data"], item["md"], True)
            self._shown["panel"] = None
        elif op == "dropped":
            sink.write("stderr", f"taas: {item['n']:,} output records dropped here: the job's log keeps its "
                       f"first and its latest output (TAAS_LOG_CAP)\n")

    def _stale(self, kind: str, name: str, view: dict) -> bool:
        """Whether ``view`` was saved before the log's record that ended ``name``."""
        ended = self._ended.get((kind, name))
        return ended is not None and view.get("n", 0) <= ended

    def _update(self, view: dict) -> None:
        sink = self.sink
        for where, text in (view.get("progress") or {}).items():
            if self._stale("progress", where, view):
                continue
            if self._shown["progress"].get(where) != text and hasattr(sink, "progress"):
                key, stream = where.split("\n", 1)
                sink.progress(key, stream, text, False)
                self._shown["progress"][where] = text
        panel = None if self._stale("panel", "", view) else view.get("panel")
        if hasattr(sink, "panel"):
            if panel and panel != self._shown["panel"]:
                sink.panel(panel["data"], panel["md"], False)
            elif not panel and self._shown["panel"]:
                last = self._shown["panel"]
                sink.panel(last["data"], last["md"], True)
        self._shown["panel"] = panel
        if hasattr(sink, "live"):
            for name, shown in (view.get("live") or {}).items():
                if self._stale("live", name, view):
                    continue
                if self._shown["live"].get(name) != shown:
                    sink.live(name, shown["data"], shown["md"], False)
                    self._shown["live"][name] = shown

    def finish(self) -> None:
        """The last records, and what was shown in place closed."""
        self.step()
        sink = self.sink
        if self._shown["panel"] and hasattr(sink, "panel"):
            sink.panel(self._shown["panel"]["data"], self._shown["panel"]["md"], True)
        for where, text in self._shown["progress"].items():
            key, stream = where.split("\n", 1)
            sink.progress(key, stream, text, True)
        self._shown = {"progress": {}, "panel": None, "live": {}}


def _latest(items: list[dict], budget: int) -> list[dict]:
    """The last ``budget`` bytes of text of ``items`` (whole lines), and every other record."""
    out: list[dict] = []
    for item in reversed(items):
        if item.get("op") != "w":
            out.append(item)
            continue
        if budget <= 0:
            continue
        text = item["x"]
        if len(text) > budget:
            cut = text.find("\n", len(text) - budget)
            text = text[cut + 1:] if cut >= 0 else ""
        budget -= len(text)
        if text:
            out.append(dict(item, x=text))
    return out[::-1]


def follow(store: Store, job_id: str, sink, *, latest: int | None = LATEST,
           on_metrics: Callable | None = None) -> JobRecord:
    """Show job ``job_id`` from its latest output, then live, until it ends (a kept job: until its
    cell ends and the ranks wait): its record then.  KeyboardInterrupt leaves the job running (the caller says so)."""
    follower = Follower(store, job_id, sink, latest=latest, on_metrics=on_metrics)
    # Records on disk wake the follower as they change; a cluster's (taas.host.ray) are looked at.
    folder = store.folder(job_id) if isinstance(store, Store) else None
    with Changes(folder, fallback=POLL) as changes:
        while True:
            follower.step()
            record = store.read(job_id)
            if record.state.final or record.state is State.KEPT:  # kept: its cell ended, the ranks wait
                follower.finish()
                return record
            changes.wait(LOOK)


def take(store: Store, record: JobRecord) -> Returned:
    """Rank 0's names and Out[] of the finished job ``record``, once: a second take is refused."""
    data = store.claim(record.id, records.RESULTS)  # the one atomic claim
    if data is None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.taken)) if record.taken else "earlier"
        raise JobError(f"taas: job {record.id}'s results were already taken ({when}); its output "
                       f"is still there: `taas logs {record.id}`")
    returned: Returned = pickle.loads(data)
    with contextlib.suppress(OSError):
        (store.folder(record.id) / records.TAKEN).touch(mode=0o600)
    return returned


def raise_failure(store: Store, record: JobRecord) -> None:
    """What an attached cell would have raised for a job that did not succeed."""
    if record.state is State.FAILED:
        try:
            failure = Failure(**json.loads(store.get(record.id, FAILURE) or b""))
        except (OSError, ValueError, TypeError):
            raise JobFailed(f"job {record.id} failed: {record.cause}") from None
        if failure.kind in ("JobFailed", "CellSyntaxError") or failure.rendered:
            raise JobFailed(failure.summary, list(failure.rendered) or None)
        raise LaunchError(failure.summary)
    if record.state is State.CANCELLED:
        raise JobError(f"taas: job {record.id} was cancelled; nothing came back")
    if record.state is State.LOST:
        raise JobError(f"taas: job {record.id} is lost: {record.cause}")


def cancel(store: Store, job_id: str) -> JobRecord:
    """Stop job ``job_id``: SIGTERM to its host (the pid its record names, if that process
    started when the record says), then wait until it is gone; its final record."""
    record = store.read(job_id)
    if record.state.final:
        raise JobError(f"taas: job {job_id} already ended ({record.state.value}); nothing to cancel")
    deadline = time.monotonic() + 30.0
    while record.host_pid == 0 and not record.state.final and time.monotonic() < deadline:
        time.sleep(POLL)  # the host is starting: it writes its pid first thing
        record = store.read(job_id)
    host = _host(record)
    if host is not None:
        with contextlib.suppress(psutil.Error):
            host.send_signal(signal.SIGTERM)
        try:
            host.wait(CANCEL_GRACE * 2)
        except psutil.TimeoutExpired:
            host.kill()
        except psutil.Error:
            pass
    for _ in range(int(CANCEL_GRACE / POLL)):
        record = store.read(job_id)
        if record.state.final:
            break
        time.sleep(POLL)
    return record


def _host(record: JobRecord) -> psutil.Process | None:
    if not record.host_pid:
        return None
    try:
        process = psutil.Process(record.host_pid)
        if abs(process.create_time() - record.host_started) > 0.01:
            return None  # the pid was reused: not our host
        return process
    except psutil.Error:
        return None


def load(returned: Returned) -> tuple[dict, object, bool, list[str]]:
    """The values of ``returned``, each unpickled on its own: names, Out[], has_out, notes."""
    values, notes = {}, []
    for name, data in returned.values.items():
        try:
            values[name] = pickle.loads(data)
        except Exception as exc:  # one value that cannot be read costs itself, not the others
            notes.append(f"taas: `{name}` could not be read back: {type(exc).__name__}: {exc}")
    out, has_out = None, returned.has_out
    if has_out:
        try:
            out = pickle.loads(returned.out or b"")
        except Exception as exc:  # the same for Out[]
            has_out = False
            notes.append(f"taas: Out[] could not be read back: {type(exc).__name__}: {exc}")
    return values, out, has_out, notes


__all__ = ["Follower", "JobError", "RenderedError", "Store", "cancel", "follow", "load",
           "raise_failure", "running_copy", "start", "take"]
