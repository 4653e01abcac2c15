"""The messages on the kernel's hub connections (TCP transport), typed at both ends.

Each travels as one length-prefixed JSON object (:func:`taas.data.tcp.wire.send_message`)
whose ``op`` names its class::

    relay -> hub            RelayUp(node, host, port)      node n's relay listens there
    hub -> relay            JobLayout(loaders, ranks_per_node)   what to make: per loader its
                                                           workers, (worker, rank) pairs, bound
    loader worker -> hub    WhereIs(node)                  where is node n's relay?
    hub -> loader worker    RelayAt(host, port)
    kernel -> relay         Query(loader)                  the control words, please
    relay -> kernel         ControlReport(workers, wanted)  per worker a WorkerReport (None:
                                                           never reported there); {channel:
                                                           (unit, seconds waited)}
    kernel -> relay         Fail(loader, worker, text)     a loader worker failed (kept ranks):
                                                           the relay marks it in its node's
                                                           header, answered by an empty
                                                           ControlReport (one reply per message)

``JobLayout.failures`` carries the failures marked before that relay registered.

:func:`decode` checks every field's type and raises :class:`BadMessage` for anything else;
each reader logs and ignores a message it cannot read (see its call site for what that means
there).  Nothing read from a socket is ever unpickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


class BadMessage(ValueError):
    """A hub message that is not one of this module's (or not the one expected here)."""


@dataclass(frozen=True)
class RelayUp:
    OP: ClassVar[str] = "relay"
    node: int
    host: str
    port: int


@dataclass(frozen=True)
class WhereIs:
    OP: ClassVar[str] = "where"
    node: int


@dataclass(frozen=True)
class RelayAt:
    OP: ClassVar[str] = "at"
    host: str
    port: int


@dataclass(frozen=True)
class LoaderLayout:
    workers: int
    pairs: tuple  # ((worker, rank), ...): channel i is pairs[i]
    bound: int  # bytes in flight, all channels together


@dataclass(frozen=True)
class JobLayout:
    OP: ClassVar[str] = "layout"
    loaders: dict  # loader -> LoaderLayout
    ranks_per_node: object  # int, a tuple of each rank's node, or None (see relay.node_of)
    failures: tuple = ()  # Fail messages marked before the relay registered


@dataclass(frozen=True)
class Fail:
    """Loader ``loader``'s worker ``worker`` failed (``text``: the kernel's one line): kept
    ranks' views raise it (:meth:`taas.data.transport.Transport.fail`)."""

    OP: ClassVar[str] = "fail"
    loader: int
    worker: int
    text: str


@dataclass(frozen=True)
class Query:
    OP: ClassVar[str] = "query"
    loader: int


@dataclass(frozen=True)
class WorkerReport:
    """A loader worker as one node's relay last saw it (durations: no clock crosses machines)."""

    state: int
    unit: int
    busy_s: float
    prefetched: bool
    produced: int
    seq: int  # the sequence number of its last CONTROL frame there
    blocked: bool  # the relay waits for room in one of its rings there


@dataclass(frozen=True)
class ControlReport:
    OP: ClassVar[str] = "control"
    workers: tuple  # WorkerReport or None per worker
    wanted: dict  # channel -> (unit, seconds waited)


Message = RelayUp | WhereIs | RelayAt | JobLayout | Query | ControlReport | Fail


def encode(message: Message) -> dict:
    """``message`` as a JSON-ready dict."""
    if isinstance(message, JobLayout):
        body: dict = {"loaders": {str(k): {"workers": v.workers, "pairs": [list(p) for p in v.pairs],
                                           "bound": v.bound} for k, v in message.loaders.items()},
                      "ranks_per_node": (list(message.ranks_per_node) if isinstance(message.ranks_per_node, tuple)
                                         else message.ranks_per_node),
                      "failures": [[f.loader, f.worker, f.text] for f in message.failures]}
    elif isinstance(message, ControlReport):
        body = {"workers": [None if w is None else [w.state, w.unit, w.busy_s, w.prefetched, w.produced,
                                                    w.seq, w.blocked] for w in message.workers],
                "wanted": {str(c): [u, s] for c, (u, s) in message.wanted.items()}}
    else:
        body = dict(vars(message))
    return {"op": message.OP, **body}


def decode(data, *expected: type) -> Message:
    """The message ``data`` (a decoded JSON value) holds, one of ``expected`` (any if none);
    :class:`BadMessage` if it is not one."""
    if not isinstance(data, dict):
        raise BadMessage(f"not a JSON object: {_short(data)}")
    cls = _BY_OP.get(data.get("op"))  # type: ignore[arg-type]
    if cls is None or (expected and cls not in expected):
        raise BadMessage(f"unexpected message: {_short(data)}")
    try:
        return _DECODERS[cls](data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field missing or ill-shaped
        raise BadMessage(f"malformed {cls.OP} message ({type(exc).__name__}: {exc}): {_short(data)}") from None


def _short(data) -> str:
    text = repr(data)
    return text if len(text) <= 200 else text[:200] + "..."


def _int(value) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a whole number")
    return value


def _float(value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{value!r} is not a duration")
    return float(value)


def _bool(value) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{value!r} is not true or false")
    return value


def _str(value) -> str:
    if type(value) is not str:
        raise ValueError(f"{value!r} is not a string")
    return value


def _pair(value) -> tuple[int, int]:
    a, b = value  # ValueError / TypeError unless two items
    return _int(a), _int(b)


def _loader_layout(d: dict) -> LoaderLayout:
    return LoaderLayout(_int(d["workers"]), tuple(_pair(p) for p in d["pairs"]), _int(d["bound"]))


def _ranks_per_node(value):
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(_int(n) for n in value)
    return _int(value)


def _worker_report(value) -> WorkerReport | None:
    if value is None:
        return None
    state, unit, busy, prefetched, produced, seq, blocked = value
    return WorkerReport(_int(state), _int(unit), _float(busy), _bool(prefetched), _int(produced), _int(seq),
                        _bool(blocked))


def _fail(value) -> Fail:
    loader, worker, text = value
    return Fail(_int(loader), _int(worker), _str(text))


def _wanted(value) -> tuple[int, float]:
    unit, waited = value
    return _int(unit), _float(waited)


_DECODERS = {
    RelayUp: lambda d: RelayUp(_int(d["node"]), _str(d["host"]), _int(d["port"])),
    WhereIs: lambda d: WhereIs(_int(d["node"])),
    RelayAt: lambda d: RelayAt(_str(d["host"]), _int(d["port"])),
    JobLayout: lambda d: JobLayout({_int(int(k)): _loader_layout(v) for k, v in d["loaders"].items()},
                                   _ranks_per_node(d["ranks_per_node"]),
                                   tuple(_fail(f) for f in d.get("failures", []))),
    Fail: lambda d: Fail(_int(d["loader"]), _int(d["worker"]), _str(d["text"])),
    Query: lambda d: Query(_int(d["loader"])),
    ControlReport: lambda d: ControlReport(tuple(_worker_report(w) for w in d["workers"]),
                                           {_int(int(c)): _wanted(v) for c, v in d["wanted"].items()}),
}
_BY_OP = {cls.OP: cls for cls in _DECODERS}
