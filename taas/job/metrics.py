"""Metrics: what ``taas.log(step=..., **scalars)`` records, both ends of the rows' trip.

    a rank      taas.log -> the recorder the rank runtime installed (taas.rank.metrics: a
                buffer flushed as "metrics" events) -> the kernel's HISTORY, per job and rank
    notebook    taas.log -> HISTORY's own table for the notebook (no job)
    notebook    taas.metrics() -> rows out of HISTORY

:func:`log` is the one entry point; :func:`set_recorder` is how the rank runtime (a room above)
hands its buffer down, so this module never imports anything of taas.  :func:`scalar` is the
one rule for what a value may be (a finite int or float, or something with one: numpy scalars,
one-element tensors); both ends use it.  The wire: an event ``{"kind": "metrics", "rows":
[[step, {name: number, ...}], ...]}``.

Pure: no processes, no threads, no numpy; rows are kept column by column (``array``), so ten
thousand steps of a few scalars cost a few hundred kilobytes, not a dict per row.
"""

from __future__ import annotations

import math
import sys
import threading
from array import array
from collections.abc import Callable, Iterator

KIND = "metrics"  # the event's kind on the events pipe
ROWS_PER_EVENT = 1000  # rows per event line: lines stay small however fast a rank logs

Recorder = Callable[[int | None, dict], None]
_recorder: Recorder | None = None  # None: the notebook (HISTORY's table without a job)


def set_recorder(recorder: Recorder | None) -> None:
    """Where :func:`log` records from now on (None: the notebook's own history)."""
    global _recorder
    _recorder = recorder


def log(step: int | None = None, **scalars) -> None:
    """``taas.log``: record ``scalars`` at ``step`` (None: one past this process's last step)."""
    (_recorder or HISTORY.notebook.log)(step, scalars)


def record(step: int | None, scalars: dict) -> None:
    """:func:`log` with the scalars as a dict the recorder may keep (one repacking less)."""
    (_recorder or HISTORY.notebook.log)(step, scalars)


# -- the value rule ---------------------------------------------------------------------------
def scalar(value) -> tuple[float | None, str]:
    """(the number ``value`` stands for, "") or (None, why it is not recorded)."""
    kind = type(value)
    if kind is float:
        return (value, "") if math.isfinite(value) else (None, f"is {value}, not a finite number")
    if kind is int or kind is bool:
        return float(value), ""
    if isinstance(value, (str, bytes, dict, list, tuple, set)) or value is None:
        return None, f"is {_kind(value)}, not a number"
    item = getattr(value, "item", None)  # numpy scalars and arrays, torch tensors
    size = getattr(value, "numel", None) or getattr(value, "size", None)  # torch, numpy
    size = size() if callable(size) else size
    if callable(item) and size in (1, None):
        try:
            return scalar(item())
        except (TypeError, ValueError, RuntimeError) as exc:
            return None, f"could not be read as a number ({type(exc).__name__})"
    try:
        number = float(value)  # fractions, decimals, anything with __float__
    except (TypeError, ValueError):
        return None, f"is {_kind(value)}, not a number"
    return scalar(number)


def step_of(step) -> tuple[int | None, str]:
    """(``step`` as an int, "") or (None, why it is not a step)."""
    if type(step) is int:
        return step, ""
    number, why = scalar(step)
    if number is None or number != int(number):
        return None, why or f"is {number}, not a whole number"
    return int(number), ""


def _kind(value) -> str:
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


class Notes:
    """One line per metric name that could not be recorded (the first reason), then silence."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write
        self.seen: set[str] = set()

    def __call__(self, name: str, why: str) -> None:
        if name not in self.seen:
            self.seen.add(name)
            self.write(f"taas: taas.log: {name!r} {why}: not recorded (the job goes on)")


def check(step, scalars: dict, last_step: int, notes: Notes) -> tuple[int, dict[str, float]] | None:
    """``taas.log``'s arguments as (step, {name: number}), bad values left out with a note;
    None when no value is left or the step is not a whole number."""
    if step is None:
        step = last_step + 1
    elif type(step) is not int:
        step, why = step_of(step)
        if step is None:
            notes("step", why)
            return None
    values = {}
    for name, value in scalars.items():
        if type(value) is float and math.isfinite(value):  # the common case, first and fast
            values[name] = value
            continue
        number, why = scalar(value)
        if number is None:
            notes(name, why)
        else:
            values[name] = number
    return (step, values) if values else None


def _print_note(line: str) -> None:
    print(line, file=sys.stderr)


# -- the kernel's history -----------------------------------------------------------------------
class Table:
    """Rows of one rank (or of the notebook) in one job, column by column: ``steps`` and one
    float column per name, NaN where a row did not have that name."""

    def __init__(self) -> None:
        self.steps = array("q")
        self.columns: dict[str, array] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: int, values: dict[str, float]) -> None:
        n = len(self.steps)
        self.steps.append(step)
        for name, value in values.items():
            column = self.columns.get(name)
            if column is None:  # a new name: NaN for the rows before (once per name)
                column = self.columns[name] = array("d", [math.nan]) * n
            column.append(value)
        if len(values) < len(self.columns):
            for column in self.columns.values():
                if len(column) == n:
                    column.append(math.nan)

    def rows(self) -> Iterator[tuple[int, dict[str, float]]]:
        columns = list(self.columns.items())
        for i, step in enumerate(self.steps):
            yield step, {name: c[i] for name, c in columns if c[i] == c[i]}  # NaN: not in that row

    def series(self, name: str) -> tuple[array, array]:
        """(steps, values) of ``name``, NaN where a row lacked it (the plot skips those)."""
        return self.steps, self.columns.get(name, array("d"))


class NotebookTable(Table):
    """The notebook's own rows (``taas.log`` outside a job)."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self.lock = lock
        self.notes = Notes(_print_note)

    def log(self, step, scalars: dict) -> None:
        with self.lock:
            row = check(step, scalars, self.steps[-1] if self.steps else -1, self.notes)
            if row is not None:
                self.add(*row)


class History:
    """Every row this kernel saw: per job (in order) and rank, and the notebook's own.

    ``rows(which)``: ``"last"`` the last job that logged anything (the notebook's own rows
    while no job did), ``"all"`` every job and the
    notebook (with a ``job`` column: the job's id, None for the notebook's rows), ``"notebook"``
    the notebook's own, or a job id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the supervisor adds while notebook threads may log
        self.jobs: dict[str, dict[int, Table]] = {}  # job id -> rank -> rows, oldest job first
        self.notebook = NotebookTable(self.lock)
        # Called with (job_id, rank, rows) after each add: a job host records them for viewers.
        self.observers: list = []

    def add(self, job_id: str, rank: int | None, rows) -> int:
        """``rows`` (``(step, {name: number})`` pairs, checked by the events reader) of ``rank``;
        how many were added (none from a process that is not a rank)."""
        if rank is None:
            return 0
        with self.lock:
            table = self.jobs.setdefault(job_id, {}).setdefault(rank, Table())
            for step, values in rows:
                table.add(step, values)
        for observer in self.observers:
            observer(job_id, rank, rows)
        return len(rows)

    def series(self, job_id: str, rank: int = 0) -> dict[str, tuple[array, array]]:
        """name -> (steps, values) of ``rank`` in job ``job_id``: what the live plot draws
        (copies: the plot draws them in a thread of its own while rows keep coming)."""
        with self.lock:
            table = self.jobs.get(job_id, {}).get(rank)
            if table is None:
                return {}
            steps = table.steps[:]
            return {name: (steps, column[:]) for name, column in table.columns.items()}

    def last_job(self) -> str | None:
        logged = [job for job, tables in self.jobs.items() if any(len(t) for t in tables.values())]
        return logged[-1] if logged else None

    def rows(self, which: str = "last") -> list[dict]:
        with self.lock:
            if which == "notebook":
                return [_row(step, None, values) for step, values in self.notebook.rows()]
            if which == "all":
                out = [{"job": None, **_row(step, None, values)} for step, values in self.notebook.rows()]
                for job_id in self.jobs:
                    out += [{"job": job_id, **row} for row in self._job_rows(job_id)]
                return out
            job = self.last_job() if which == "last" else which
            if job is None:  # no job logged yet: the notebook's own rows
                return [_row(step, None, values) for step, values in self.notebook.rows()]
            if job not in self.jobs:
                raise ValueError(f"taas.metrics: no job {which!r} logged in this kernel; "
                                 f"'last', 'all', 'notebook' or one of {list(self.jobs)}")
            return self._job_rows(job)

    def _job_rows(self, job: str) -> list[dict]:
        out = []
        for rank in sorted(self.jobs[job]):
            out += [_row(step, rank, values) for step, values in self.jobs[job][rank].rows()]
        out.sort(key=lambda row: row["step"])  # stable: ranks in order within a step
        return out


def _row(step: int, rank: int | None, values: dict) -> dict:
    return {"step": step, "rank": rank, **values}


HISTORY = History()


def frame(rows: list[dict]):
    """``rows`` as a pandas DataFrame when pandas is installed (imported only then), else as they are."""
    try:
        import pandas as pd
    except ImportError:
        return rows
    return pd.DataFrame(rows)
