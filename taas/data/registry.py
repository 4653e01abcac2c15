"""``taas.register(loader)`` and friends: which loaders the data plane serves.

A registered loader stays registered (a strong reference, by identity) until
``taas.unregister``.  Registration checks what would otherwise fail later, inside a loader
worker: the loader must be iterable, must not be a one-shot iterator, and must survive a
cloudpickle round trip (that is how it travels to the loader workers).  No torch import here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from taas.errors import RegistrationError

__all__ = ["WorkerInfo", "register", "unregister", "is_registered", "registered", "get_worker_info"]


class WorkerInfo(NamedTuple):
    """Who this rank is, as DataSphere's client reports it: ``id`` = RANK, ``num_workers`` =
    WORLD_SIZE."""

    id: int
    num_workers: int


@dataclass
class Entry:
    loader: object
    prefetch: int | None = None  # units ready before the ranks start (None: automatic)
    buffer_mb: float | None = None  # bytes in flight to the ranks (None: automatic)
    # Notebook names that referred to the loader -> id of the object last noted as having
    # replaced it there (None: not replaced, or not noted yet).
    names: dict = field(default_factory=dict)


_entries: dict[int, Entry] = {}  # id(loader) -> Entry; insertion order = registration order


def register(loader, *, prefetch: int | None = None, buffer_mb: float | None = None) -> None:
    """Serve ``loader`` through the data plane in every taas cell that reads it.

    In a cell run with ``--gpus N --cpus M --units K`` the loader's name is, in each rank, a view
    that yields that rank's share of K units produced by M loader worker processes.

    ``prefetch``: how many units must be ready before the ranks start (default: a tenth of K,
    or less when the buffer fills first).  ``buffer_mb``: how many MB of units may wait for the
    ranks (default 256); loader workers block when it is full.
    """
    if id(loader) in _entries:
        raise RegistrationError(f"{_describe(loader)} is already registered; "
                                "taas.unregister() it first to register it again")
    kind = type(loader)
    if not (hasattr(kind, "__iter__") or hasattr(kind, "__getitem__")):
        raise RegistrationError(f"cannot register {_describe(loader)}: it is not iterable "
                                "(register a DataLoader, a Dataset or any object a `for` loop takes)")
    if hasattr(kind, "__next__") or _is_generator(loader):
        raise RegistrationError(f"cannot register {_describe(loader)}: it is an iterator, good for "
                                "one pass only; register the iterable it comes from (a DataLoader, "
                                "a list, an object whose __iter__ starts a new pass)")
    if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
        raise RegistrationError(f"prefetch must be a positive number of units, got {prefetch!r}")
    if buffer_mb is not None and not (isinstance(buffer_mb, (int, float)) and buffer_mb > 0):
        raise RegistrationError(f"buffer_mb must be a positive number, got {buffer_mb!r}")
    _check_round_trip(loader)
    _entries[id(loader)] = Entry(loader, prefetch, buffer_mb)
    remember_names(_user_namespace() or {})


def unregister(loader) -> None:
    """Stop serving ``loader``: taas cells get the plain object again."""
    if _entries.pop(id(loader), None) is None:
        raise RegistrationError(f"{_describe(loader)} is not registered")


def is_registered(loader) -> bool:
    return id(loader) in _entries


def entry(loader) -> Entry | None:
    """The registration of ``loader`` (by identity), or None."""
    found = _entries.get(id(loader))
    return found if found is not None and found.loader is loader else None


def remember_names(namespace: dict) -> None:
    """Note which names of ``namespace`` refer to registered loaders (see :func:`rebound`)."""
    for name, value in namespace.items():
        if not name.startswith("_"):
            found = entry(value) if _entries else None
            if found is not None:
                found.names[name] = None


def rebound(namespace: dict, names) -> list[str]:
    """One-line notes for the ``names`` (that a cell reads) which referred to a registered
    loader but now hold another, unregistered object: re-defined after ``taas.register``, the
    ranks get the new object as a plain value.  Each replacement is noted once."""
    notes = []
    for name in sorted(names):
        if name not in namespace:
            continue
        value = namespace[name]
        for item in _entries.values():
            if name not in item.names or item.loader is value:
                continue
            if entry(value) is not None or item.names[name] == id(value):
                continue  # the name now holds another registered loader, or this was noted
            item.names[name] = id(value)
            notes.append(
                f"taas: `{name}` is no longer the loader registered with taas.register (it was "
                f"assigned again): the ranks get the new {_type_name(value)} as a plain value; "
                f"call taas.register({name}) to serve it through the data plane")
            break
    return notes


def registered() -> list[str]:
    """The registered loaders: their names in the notebook (see :func:`set_namespace_source`), else reprs."""
    names_of: dict[int, list[str]] = {}
    namespace = _user_namespace()
    for name, value in (namespace or {}).items():
        if not name.startswith("_") and id(value) in _entries and _entries[id(value)].loader is value:
            names_of.setdefault(id(value), []).append(name)
    out = []
    for key, item in _entries.items():
        names = names_of.get(key)
        out.extend(sorted(names) if names else [object.__repr__(item.loader)])
    return out


def get_worker_info() -> WorkerInfo | None:
    """In a rank of a taas job: ``WorkerInfo(id=RANK, num_workers=WORLD_SIZE)``; else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return WorkerInfo(int(rank), int(world))
    except ValueError:
        return None


# -- helpers ---------------------------------------------------------------------------------
def _describe(loader) -> str:
    kind = type(loader)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{kind.__qualname__}"
    return f"this {name}"


def _is_generator(value) -> bool:
    import types

    return isinstance(value, (types.GeneratorType, types.AsyncGeneratorType))


# Where the notebook's names live: a function returning the user namespace (or None), set by
# the layer that knows the notebook (taas/__init__.py: IPython's shell when one runs).  None
# here: plain Python, loaders are shown by repr.  The registry never looks for IPython itself.
_namespace_source: Callable[[], dict | None] | None = None


def set_namespace_source(source: Callable[[], dict | None] | None) -> None:
    """Tell the registry where the notebook's names are (None: nowhere; reprs are shown)."""
    global _namespace_source
    _namespace_source = source


def _user_namespace() -> dict | None:
    return _namespace_source() if _namespace_source is not None else None


def _check_round_trip(loader) -> None:
    import cloudpickle

    from taas.job import crossing

    try:
        # As plane.open ships it.  (The loads below runs in the kernel: for a class defined in
        # the notebook, cloudpickle sets the unpickled methods back onto the notebook's own
        # class, so they must keep their cell's file name -- crossing's pickler does.)
        blob = crossing.dumps(loader, crossing.TO_RANK)
    except Exception as exc:  # any pickling failure becomes the one-line RegistrationError
        where, culprit = _culprit(loader)
        found = f" (`{where}` is {_type_name(culprit)})" if where else ""
        raise RegistrationError(
            f"cannot register {_describe(loader)}: it cannot be shipped to loader workers"
            f"{found}: {_first_line(exc)}. Create such objects lazily inside the dataset "
            "(e.g. open files in __getitem__), not when the loader is built") from None
    try:
        cloudpickle.loads(blob)
    except Exception as exc:  # user __setstate__ may raise anything: one-line RegistrationError
        raise RegistrationError(
            f"cannot register {_describe(loader)}: it pickles but does not unpickle, so loader "
            f"workers could not rebuild it: {type(exc).__name__}: {_first_line(exc)}") from None


def _culprit(value, path: str = "loader", depth: int = 0, seen: set | None = None):
    """(attribute path, value) of the innermost attribute that cannot be pickled."""
    import cloudpickle

    seen = seen if seen is not None else set()
    if depth > 4 or id(value) in seen:
        return None, None
    seen.add(id(value))
    children = []
    if isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    try:
        children += [(f"{path}.{k}", v) for k, v in vars(value).items()]
    except TypeError:
        pass
    for child_path, child in children:
        try:
            cloudpickle.dumps(child)
        except Exception:  # any failure marks this child as the culprit to look into
            deeper = _culprit(child, child_path, depth + 1, seen)
            return deeper if deeper[0] else (child_path, child)
    return None, None


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
