"""The job record's contract: its states, its fields, where records live.

    WAITING ──> RUNNING ──┬─> DONE        rank 0's results wait in the record until taken
       │                  ├─> KEPT        --keep: the first cell ended (its results or failure
       │                  │      │        wait), the ranks stay for a notebook to adopt them;
       │                  │      └──────> DONE (released, idle limit), CANCELLED, LOST
       │                  ├─> FAILED      the root cause in one line (``cause``), its traceback kept
       │                  ├─> CANCELLED   ``taas cancel`` / ``%taas cancel``: every process stopped
       └──────────────────┴─> LOST        the host ended without a word (killed, the machine
                                           restarted): set by whoever finds its lock free

A record is written only by its host, except LOST (by a reader holding the host's lock, which
proves the host gone).  The notebook that takes the results leaves a marker file (``taken``)
beside it instead of writing it.  Every other process only reads.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
from dataclasses import dataclass, field

RECORD = "record.json"
LOCK = "lock"
PREPARED = "job.pkl"  # a cell the kernel made into a Job (taas.host.api.Prepared)
RESULTS = "results.pkl"
VIEW = "view.json"
TAKEN = "taken"  # made by the notebook that took the results (its mtime: when)
OUT = "out"  # the output log (log.py)
METRICS = "metrics"  # taas.log rows, a log of its own: every row since the start

# A job's output on disk is bounded: its first half and its latest half (log.py).
LOG_CAP = 64 << 20
# Finished records older than this go when records are listed (seconds).
MAX_AGE = 14 * 86400


class State(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    KEPT = "kept"  # --keep --detach: the ranks wait between cells (taas.host.kept)
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def final(self) -> bool:
        return self not in (State.WAITING, State.RUNNING, State.KEPT)


@dataclass(frozen=True)
class JobRecord:
    """One detached job, as its record says."""

    id: str
    state: State
    ranks: int
    where: str  # "this machine" or the cluster's address
    started: float  # time.time()
    notebook: str = ""  # the notebook's path when the kernel knew it (JPY_SESSION_NAME)
    first_line: str = ""  # the cell's first line of code
    source_hash: str = ""  # the cell's source: a re-run of the same cell attaches
    cwd: str = ""
    host_pid: int = 0
    host_started: float = 0.0  # the host's start time (psutil's create_time): pids are reused
    device: str = ""
    ended: float | None = None
    cause: str = ""  # a failed or lost job: why, in one line
    taken: float | None = None  # when a notebook took the results (read from the TAKEN marker)
    has_results: bool = False  # results.pkl was written
    keep: bool = False  # --keep: the ranks live on after the cell

    def replace(self, **changes) -> JobRecord:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_json(cls, data: dict) -> JobRecord:
        if not isinstance(data, dict):
            raise TypeError(f"a record is a JSON object, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["state"] = State(values["state"])
        return cls(**values)


@dataclass
class Listed:
    """A record as ``taas jobs`` shows it."""

    record: JobRecord
    size: int = 0  # bytes the record takes on disk
    problem: str = ""  # a record that could not be read: why
    extra: dict = field(default_factory=dict)


def default_root() -> pathlib.Path:
    """Where this user's job records live: ``$TAAS_HOME/jobs``, else
    ``$XDG_STATE_HOME/taas/jobs``, else ``~/.local/state/taas/jobs``."""
    home = os.environ.get("TAAS_HOME")
    if home:
        return pathlib.Path(home) / "jobs"
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return pathlib.Path(state) / "taas" / "jobs"


def log_cap() -> int:
    """The output log's cap in bytes (``TAAS_LOG_CAP``, e.g. ``64M``, ``1G``)."""
    return _size(os.environ.get("TAAS_LOG_CAP"), LOG_CAP)


def max_age() -> float:
    """How long finished records stay (``TAAS_JOBS_MAX_AGE``: seconds, or ``14d``, ``12h``)."""
    text = os.environ.get("TAAS_JOBS_MAX_AGE")
    if not text:
        return MAX_AGE
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1].lower() in units:
            return float(text[:-1]) * units[text[-1].lower()]
        return float(text)
    except ValueError:
        return MAX_AGE


def _size(text: str | None, default: int) -> int:
    if not text:
        return default
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    try:
        if text[-1].lower() in units:
            return max(4096, int(float(text[:-1]) * units[text[-1].lower()]))
        return max(4096, int(text))
    except ValueError:
        return default
