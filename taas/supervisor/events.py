"""The events pipe, kernel side: each line a process wrote, read into a typed message or dropped.

Processes write one JSON object a line (:func:`taas.launch.process.events.send`: ``kind`` plus
fields).  The pipe's fd is in every rank's environment (``TAAS_EVENTS_FD``), so the rank's own
code can write to it as well as taas: a line is untrusted input.  :func:`parse` therefore checks
each message's whole shape before anything uses it, and a line that is not one of the messages
below (not JSON, not an object, an unknown kind, a field of the wrong type) is logged and
ignored: it never fails the job, and the job's output and results still arrive.

    display   rank 0's ``display()`` / figures: a MIME bundle and its metadata  -> :class:`Display`
    stack     where a rank is, asked for (taas.launch.process.stacks)           -> :class:`Stack`
    up        a rank started the cell's preamble (--stall counts from all up)   -> :class:`Up`
    done      a rank ran the cell to its end and sent all it had                -> :class:`Done`
              (a kept rank: also after the cell raised, with failed=true: it stays for the next)
    metrics   rows a rank's ``taas.log`` recorded (taas.rank.metrics)            -> :class:`Metrics`
    comm      how many operations a rank made on its process groups, how much it trained -> :class:`Comm`
    data.*    the data plane's figures (progress, prefetch, stats)              -> :class:`DataFigure`
    beat      a rank's figures every second, for the live panel (taas.rank.heartbeat) -> :class:`Beat`
    ask       a rank's input() or pdb prompt wants a line from the notebook's input box
              (taas.launch.process.stdin; answered with JobHandle.answer)              -> :class:`Ask`
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SHOWN = 200  # characters of a dropped line repeated in the log


@dataclass(frozen=True)
class Display:
    data: dict[str, Any]  # MIME type -> content
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Stack:
    line: int | None  # the innermost line of the cell the rank is at (None: not in the cell)
    call: str  # that line's source text
    frames: tuple[dict, ...]  # outermost first: filename, lineno, name, line
    debugger: bool = False  # the rank is in the debugger (not a hang)


@dataclass(frozen=True)
class Up:
    pass


@dataclass(frozen=True)
class Done:
    failed: bool = False  # a kept rank whose cell raised: its report is written, it waits on
    gpu_mem: int | None = None  # a kept rank's: bytes its tensors hold on its GPU (None: no GPU)


@dataclass(frozen=True)
class Comm:
    ops: int | None  # None: the rank could not count
    backward: int | None = 0  # backward passes the rank made (taas.rank.comm); None: unknown
    steps: int | None = 0  # optimizer steps


@dataclass(frozen=True)
class DataFigure:
    """A data-plane figure, passed on as sent (``kind`` included): the data plane reads it
    (:meth:`taas.data.plane.DataPlane.on_event`), after :func:`parse` checked the fields it uses."""

    kind: str
    message: dict[str, Any]


@dataclass(frozen=True)
class Metrics:
    """Rows a rank logged (:mod:`taas.rank.metrics`): each ``(step, {name: finite number})``."""

    rows: tuple[tuple[int, dict[str, float]], ...]


@dataclass(frozen=True)
class Beat:
    """What a rank is doing now (:mod:`taas.rank.heartbeat`), for the live panel."""

    state: str  # starting | running | waiting
    line: int | None  # the cell line it is at (None: not in the cell)
    call: str  # the function it is in ("" at the cell's top level)
    node: int  # GROUP_RANK
    cpu: float  # % since the last beat
    rss: int  # bytes
    gpu_mem: int | None  # bytes torch allocated on its GPU (None: no CUDA)
    gpu_util: int | None  # % (None: unknown)
    data: tuple[tuple[str, int, float], ...] = ()  # (loader, units taken, seconds waited)


@dataclass(frozen=True)
class Ask:
    """A rank waits for a line from the notebook's input box (:mod:`taas.launch.process.stdin`)."""

    id: int  # the question's number, repeated in the answer
    prompt: str  # shown as given (the rank tagged it: "[rank1] name? ", "(Pdb) [rank1] ")
    password: bool = False  # getpass: the box hides what is typed
    debugger: bool = False  # pdb's prompt: the rank is in the debugger
    post_mortem: bool = False  # ... at the frame its cell raised in (%pdb on)


Message = Display | Stack | Up | Done | Comm | DataFigure | Metrics | Beat | Ask


class Malformed(ValueError):
    """A line that is not a message: why, for the log."""


# -- field checks: predicates over one value, and _field, which reads one field or raises ----------
def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _int(value) or (isinstance(value, float) and math.isfinite(value))


def _frame(value: Any) -> bool:
    """A frame as taas.io.failure renders it (its ``line`` may be missing: read from the file)."""
    return (isinstance(value, dict) and isinstance(value.get("filename"), str)
            and isinstance(value.get("name"), str)
            and "lineno" in value and (value["lineno"] is None or _int(value["lineno"]))
            and isinstance(value.get("line", ""), str))


def _field(message: dict, name: str, ok: Callable[[Any], bool], what: str, default: Any = ...) -> Any:
    if name not in message:
        if default is ...:
            raise Malformed(f"no {name!r}")
        return default
    value = message[name]
    if not ok(value):
        raise Malformed(f"{name!r} is not {what}")
    return value


def _display(m: dict) -> Display:
    data = _field(m, "data", lambda v: isinstance(v, dict), "a MIME bundle (an object)")
    metadata = _field(m, "metadata", lambda v: isinstance(v, dict), "an object", {})
    return Display(data, metadata)


def _stack(m: dict) -> Stack:
    line = _field(m, "line", lambda v: v is None or _int(v), "a line number", None)
    call = _field(m, "call", lambda v: v is None or isinstance(v, str), "a string", "")
    frames = _field(m, "frames", lambda v: isinstance(v, list) and all(_frame(f) for f in v),
                    "a list of frames", [])
    return Stack(line, call or "", tuple(frames), m.get("debugger") is True)


def _comm(m: dict) -> Comm:
    def count(v):
        return v is None or _int(v)

    return Comm(_field(m, "ops", count, "a count"), _field(m, "backward", count, "a count", 0),
                _field(m, "steps", count, "a count", 0))


BEAT_STATES = ("starting", "running", "waiting", "debugger", "input")


def _count_or_none(v: Any) -> bool:
    return v is None or (_int(v) and v >= 0)


def _done(m: dict) -> Done:
    # Lenient on purpose: a "done" dropped as malformed would leave a kept cell waiting for a
    # rank that came back; a bad figure is only a figure not shown.
    gpu_mem = m.get("gpu_mem")
    return Done(failed=m.get("failed") is True, gpu_mem=gpu_mem if _count_or_none(gpu_mem) else None)


def _beat(m: dict) -> Beat:

    def figures(v: Any) -> bool:  # loader -> [units, seconds waited]
        return isinstance(v, dict) and all(
            isinstance(f, list) and len(f) == 2 and _int(f[0]) and _number(f[1]) for f in v.values())

    data = _field(m, "data", figures, "loader figures", {})
    return Beat(
        state=_field(m, "state", lambda v: v in BEAT_STATES, f"one of {', '.join(BEAT_STATES)}"),
        line=_field(m, "line", lambda v: v is None or _int(v), "a line number", None),
        call=_field(m, "call", lambda v: isinstance(v, str), "a string", ""),
        node=_field(m, "node", lambda v: _int(v) and v >= 0, "a node number", 0),
        cpu=float(_field(m, "cpu", lambda v: _number(v) and v >= 0, "a percentage", 0.0)),
        rss=_field(m, "rss", lambda v: _int(v) and v >= 0, "a count", 0),
        gpu_mem=_field(m, "gpu_mem", _count_or_none, "a count", None),
        gpu_util=_field(m, "gpu_util", _count_or_none, "a percentage", None),
        data=tuple((name, units, float(wait)) for name, (units, wait) in data.items()),
    )


# The fields of each data-plane figure that the plane reads (taas/data/plane.py: on_event and
# summary; written by taas/data/loader_worker.py and taas/data/view.py): name -> (check, what,
# default; ... for a field that must be there).
_DATA_FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str, Any]]] = {
    "data.progress": {"worker": (_int, "a worker number", ...), "produced": (_int, "a count", ...),
                      "ready": (lambda v: isinstance(v, bool), "true or false", False)},
    "data.started": {"prefetch_s": (_number, "a number", 0.0)},
    "data.stats": {"rank": (_int, "a rank", ...), "units": (_int, "a count", ...),
                   "bytes": (_int, "a count", ...), "elapsed_s": (_number, "a number", ...),
                   "wait_s": (_number, "a number", ...)},
}


def _data(m: dict) -> DataFigure:
    """A figure the data plane can use; a kind it does not know passes (the plane ignores it)."""
    _field(m, "loader", lambda v: isinstance(v, str), "a loader's name")
    for name, (ok, what, default) in _DATA_FIELDS.get(m["kind"], {}).items():
        _field(m, name, ok, what, default)
    return DataFigure(m["kind"], m)


def _ask(m: dict) -> Ask:
    prompt = _field(m, "prompt", lambda v: isinstance(v, str), "a string", "")
    return Ask(id=_field(m, "id", lambda v: _int(v) and v > 0, "a question number"),
               prompt=prompt[:4096],
               password=_field(m, "password", lambda v: isinstance(v, bool), "true or false", False),
               debugger=_field(m, "debugger", lambda v: isinstance(v, bool), "true or false", False),
               post_mortem=_field(m, "post_mortem", lambda v: isinstance(v, bool), "true or false", False))


def _metric_row(row: Any) -> bool:
    return (isinstance(row, list) and len(row) == 2 and _int(row[0]) and isinstance(row[1], dict)
            and all(isinstance(k, str) and _number(v) for k, v in row[1].items()))


def _metrics(m: dict) -> Metrics:
    rows = _field(m, "rows", lambda v: isinstance(v, list) and all(_metric_row(r) for r in v),
                  "a list of [step, {name: number}] rows")
    return Metrics(tuple((step, values) for step, values in rows))


_READERS: dict[str, Callable[[dict], Message]] = {
    "display": _display,
    "stack": _stack,
    "up": lambda m: Up(),
    "done": lambda m: _done(m),
    "comm": _comm,
    "metrics": _metrics,
    "beat": _beat,
    "ask": _ask,
}


def read(line: str) -> Message:
    """The message on ``line``; raises :class:`Malformed` for anything else."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as exc:  # also too many digits, or nesting too deep
        raise Malformed(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise Malformed(f"a JSON {type(message).__name__}, not an object")
    kind = message.get("kind")
    if not isinstance(kind, str):
        raise Malformed("no kind")
    if kind.startswith("data."):
        return _data(message)
    reader = _READERS.get(kind)
    if reader is None:
        raise Malformed(f"unknown kind {kind!r}")
    return reader(message)


def parse(key: str, line: str) -> Message | None:
    """The message process ``key`` sent on ``line``, or None (logged) when it is not one."""
    try:
        return read(line)
    except Malformed as exc:
        if line.strip():
            text = line if len(line) <= SHOWN else line[:SHOWN] + "..."
            log.warning("ignored a line on %s's events pipe: %s: %r", key, exc, text)
        return None
