"""What loader workers and ranks tell the kernel about the data plane, typed at both ends.

Each is one JSON line on the process's events pipe (:mod:`taas.launch.process.events`), its
``kind`` the class's ``KIND``::

    loader worker -> kernel   Progress(loader, worker, produced, ready, done)    data.progress
    rank -> kernel            Started(loader, rank, prefetch_s)                  data.started
                              Stats(loader, rank, units, bytes, wait_s, elapsed_s)  data.stats

:func:`send` writes one; :func:`parse` reads one back in the kernel (:mod:`taas.data.plane`).
A rank runs the user's code, which can write anything to that pipe: a line :func:`parse`
cannot read as one of these is logged on the ``taas`` logger and ignored (None), so a
malformed line never fails the job.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, Union

log = logging.getLogger("taas")


@dataclass(frozen=True)
class Progress:
    """A loader worker's units so far (throttled), whether its first slice is ready, done."""

    KIND: ClassVar[str] = "data.progress"
    loader: str
    worker: int
    produced: int
    ready: bool = False
    done: bool = False


@dataclass(frozen=True)
class Started:
    """A rank's views are installed: it waited ``prefetch_s`` for every first slice."""

    KIND: ClassVar[str] = "data.started"
    loader: str
    rank: int
    prefetch_s: float = 0.0


@dataclass(frozen=True)
class Stats:
    """A rank is done with a loader's view: what it took, and how long it waited for data."""

    KIND: ClassVar[str] = "data.stats"
    loader: str
    rank: int
    units: int
    bytes: int
    wait_s: float
    elapsed_s: float


Message = Union[Progress, Started, Stats]
_BY_KIND = {cls.KIND: cls for cls in (Progress, Started, Stats)}


def send(message: Message) -> None:
    """Write ``message`` on this process's events pipe (nothing outside a job)."""
    from taas.launch.process import events

    events.send(message.KIND, **dataclasses.asdict(message))


def _valid(value, kind: str) -> bool:
    # Exact types: JSON gives str, int, float, bool; bool is an int to isinstance.
    if kind == "str":
        return type(value) is str
    if kind == "int":
        return type(value) is int and value >= 0
    if kind == "bool":
        return type(value) is bool
    return type(value) in (int, float) and math.isfinite(value) and value >= 0  # "float"


def parse(message) -> "Message | None":
    """The typed message a decoded event line holds (its ``kind`` one of the ``KIND``\\ s);
    None, logged, if it is not one: not a dict, a field missing or of the wrong type."""
    cls = _BY_KIND.get(message.get("kind")) if isinstance(message, dict) else None
    if cls is None:
        log.warning("taas data plane: ignored an event that is not a data-plane message: %.200r", message)
        return None
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in message:
            if field.default is dataclasses.MISSING:
                log.warning("taas data plane: ignored a %s event without %r: %.200r", cls.KIND, field.name, message)
                return None
            continue
        value = message[field.name]
        if not _valid(value, field.type if isinstance(field.type, str) else field.type.__name__):
            log.warning("taas data plane: ignored a %s event whose %r is %.50r", cls.KIND, field.name, value)
            return None
        values[field.name] = value
    return cls(**values)
