"""Packaging: what a rank receives, built in the kernel before anything starts.

Only the notebook names the cell reads travel (see :mod:`taas.job.analysis`), each pickled by
cloudpickle: notebook-defined functions and classes go by value with the globals *they* read
(transitively), importable modules and classes go by reference and are re-imported by name.
A value that cannot be pickled fails the cell here, before launch, naming the variable, its
type and -- when it hides behind a function -- the path to it (``train -> sock``).

Unreferenced notebook values are never touched.  Big tensors and arrays do not go into the
pickle bytes: :mod:`taas.job.memory.bigvalues` writes them once to shared memory for the ranks to map.
IPython's ``exit``, ``quit`` and ``get_ipython``, and library objects that hold the kernel's
distributed state, cross as :mod:`taas.job.crossing` says.  Notebook CUDA tensors (modules'
parameters and buffers included) land on each rank's own GPU, ``cuda:LOCAL_RANK``
(:mod:`taas.job.devices`).
"""

from __future__ import annotations

import inspect
import io
import logging
import pickle
import re
import types
from dataclasses import dataclass, field
from typing import Callable

from taas.errors import PackagingError
from taas.job import crossing, devices
from taas.job.memory.bigvalues import BigValues

log = logging.getLogger(__name__)

# IPython's history names never travel: they mean nothing outside the kernel.  (``exit``,
# ``quit`` and ``get_ipython`` do, as their plain-Python meaning: see taas.job.crossing.)
_KERNEL_NAMES = {"In", "Out", "_ih", "_oh", "_dh", "_", "__", "___"}
# IPython's history variables: _i, _ii, _iii, _i7 (inputs) and _7 (outputs).
_HISTORY = re.compile(r"_(i{1,3}|i?\d+)$")

# How rank 0 turns what a cell display()s into a MIME bundle: "module:factory", a class whose
# instances have IPython's ``format(obj) -> (data, metadata)``; None: the object's repr.  The
# notebook layer (taas.magics) chooses it in the kernel, so no layer below it names IPython,
# and every Payload built afterwards carries it (see :func:`set_display_formatter`).
_display_formatter: str | None = None


def set_display_formatter(spec: str | None) -> None:
    """Choose what later payloads tell rank 0 to format ``display()`` with (None: repr)."""
    global _display_formatter
    _display_formatter = spec


def _rank_log_level() -> int | None:
    """The ``taas`` logger's level when the user turned it below WARNING in the kernel (the
    ranks then log at that level to their stderr, i.e. the cell); None: ranks stay silent."""
    level = logging.getLogger("taas").getEffectiveLevel()
    return level if level < logging.WARNING else None


@dataclass
class Payload:
    """Everything a rank needs to run the cell.  Plain pickle; ``names`` is cloudpickle."""

    source: str
    filename: str
    first_line: int
    names: bytes
    bound: tuple[str, ...]
    device: str
    backend: str
    pg_timeout: float
    results: bool = True
    results_to_cpu: bool = True
    loaders: dict[str, dict] = field(default_factory=dict)  # name -> data-plane settings
    # Chosen in the kernel when the payload is built, not by the caller (see above).
    display_formatter: str | None = field(default_factory=lambda: _display_formatter)
    log_level: int | None = field(default_factory=_rank_log_level)
    # The cell as typed, when ``source`` is IPython's translation of it (taas.job.syntax):
    # what tracebacks show for the cell's lines.  None: ``source`` itself.
    text: str | None = None
    post_mortem: bool = False  # IPython's %pdb on: a failing rank opens pdb where it raised


def select(free: frozenset[str] | set[str], user_ns: dict, hidden: set[str] | frozenset = frozenset()) -> dict:
    """The notebook values the cell reads: free names present in the namespace."""
    out = {}
    for name in sorted(free):
        if name in _KERNEL_NAMES or name in hidden or _HISTORY.match(name):
            continue
        if name in user_ns:
            out[name] = user_ns[name]
    return out


class _Pickler(crossing.Pickler):
    """The pickler to the ranks: :mod:`taas.job.crossing`'s registry, tensor storages on a
    device mapped to each rank's own (:mod:`taas.job.devices`), and big arrays through shared
    memory (see :mod:`taas.job.memory.bigvalues`).

    reducer_override, not persistent_id: pickle calls it only for objects that are not ints,
    strings or builtin containers, so values made of many small objects pay nothing for it."""

    def __init__(self, file, big: BigValues | None, recorded: Callable = devices.cuda_recorded):
        # (No bound method of self handed to the base class: a cycle would keep the memo, and
        # so every pickled tensor, alive until a garbage collection.)
        super().__init__(file, crossing.TO_RANK)
        self._big = big
        self._devices = devices.DeviceStorages(copy_in=big.copy_in if big is not None else None,
                                               big=big.reduce if big is not None else None,
                                               recorded=recorded)

    def reducer_override(self, obj):
        # Storages (CUDA ones mapped to the rank's device; big CPU ones through bigvalues),
        # then big arrays.
        reduced = self._devices.reduce(obj)
        if reduced is NotImplemented and self._big is not None:
            reduced = self._big.reduce(obj)
        if reduced is not NotImplemented:
            return reduced
        return super().reducer_override(obj)


class _StandInPickler(_Pickler):
    """... that also writes a name instead of each object in ``stand_ins`` (id -> name)."""

    def __init__(self, file, stand_ins: dict[int, str], big: BigValues | None, recorded: Callable):
        super().__init__(file, big, recorded)
        self._stand_ins = stand_ins

    def persistent_id(self, obj):
        return self._stand_ins.get(id(obj))


class StandIn:
    """In a rank: what arrives where the notebook had an object that must not travel (a
    registered loader, found by name among this rank's data views).

    ``resolve`` (name -> object) is given by whoever unships (the rank runtime passes the data
    plane's view lookup): packaging sits below the data plane and never imports it."""

    def __init__(self, name: str, resolve: Callable[[str], object] | None = None):
        self.name = name
        self._resolve = resolve

    def _target(self):
        if self._resolve is None:
            raise LookupError(f"no data view for registered loader {self.name!r} in this process")
        return self._resolve(self.name)

    def __iter__(self):
        return iter(self._target())

    def __len__(self):
        return len(self._target())

    def __getattr__(self, attr):
        if attr.startswith("__") or attr in ("name", "_resolve"):  # (not set yet: a copy)
            raise AttributeError(attr)
        return getattr(self._target(), attr)

    def __repr__(self) -> str:
        return f"<taas stand-in for registered loader {self.name!r}>"


class _StandInUnpickler(pickle.Unpickler):
    def __init__(self, file, resolve: Callable[[str], object] | None):
        super().__init__(file)
        self._resolve = resolve

    def persistent_load(self, pid):
        return StandIn(pid, self._resolve)


def ship(values: dict, stand_ins: dict[int, str] | None = None, big: BigValues | None = None,
         *, recorded: Callable = devices.cuda_recorded) -> bytes:
    """cloudpickle ``values`` as one blob (so shipped functions share one globals dict).

    ``stand_ins`` (id(obj) -> name) are objects that must not travel even when a shipped
    function reads them -- registered loaders, which loader workers get instead: each is
    written as its name and arrives as a :class:`StandIn`.  With ``big``, large arrays and
    tensors are written to its shared-memory files instead of into the blob; the caller
    unlinks them after the job (here when shipping fails).  Storages that ``recorded`` says are
    on a device (CUDA ones) land on each rank's own device (:mod:`taas.job.devices`).
    """
    if log.isEnabledFor(logging.DEBUG):
        log.debug("shipping %d value(s): %s", len(values), _listing(values))
        if stand_ins:
            log.debug("registered loaders travel by name: %s", ", ".join(sorted(set(stand_ins.values()))))
    try:
        buffer = io.BytesIO()
        if stand_ins:
            _StandInPickler(buffer, stand_ins, big, recorded).dump(values)
        else:
            _Pickler(buffer, big, recorded).dump(values)
        if big is not None:
            big.publish()
        blob = buffer.getvalue()
        log.debug("payload pickle: %d bytes; large arrays in shared memory: %d bytes",
                  len(blob), big.written if big is not None else 0)
        return blob
    except BaseException as exc:  # find the culprit to name it
        if big is not None:
            big.unlink()
        if not isinstance(exc, Exception):
            raise
        for name, value in values.items():
            path = _unshippable(name, value, seen=set())
            if path is not None:
                chain, culprit = path
                where = " -> ".join(chain)
                raise PackagingError(
                    f"cannot send `{where}` ({_type_name(culprit)}) to the ranks: "
                    f"{_reason(culprit)}. {_advice(chain)}"
                ) from None
        raise PackagingError(f"cannot send the cell's variables to the ranks: {exc}") from None


def _listing(values: dict) -> str:
    """``name (type)`` for each value, for the debug trail."""
    return ", ".join(f"{name} ({_type_name(value)})" for name, value in values.items()) or "none"


def _advice(chain: list[str]) -> str:
    """What to do about the value at the end of ``chain``: the cell reads it directly, or a
    notebook function (or class) reads it as a global, which travels with the function."""
    if len(chain) == 1:
        return "Create it inside the taas cell instead."
    reader, name = chain[-2], chain[-1]
    return (f"`{reader}` reads the notebook global `{name}`, which travels with it: create "
            f"`{name}` inside `{reader}`, or in the taas cell and pass it to `{reader}` as an argument.")


def _unshippable(name: str, value, seen: set[int]):
    """(path of names, culprit value) for the first value that cannot be pickled, else None."""
    if id(value) in seen:
        return None
    seen.add(id(value))
    try:
        crossing.dumps(value, crossing.TO_RANK)
        return None
    except Exception:  # any pickling failure (user __reduce__ included): look for its cause below
        pass
    # A notebook function or class fails because of a global it reads: name that global.
    for ref_name, ref_value in _referenced_globals(value).items():
        found = _unshippable(ref_name, ref_value, seen)
        if found is not None:
            return [name] + found[0], found[1]
    return [name], value


def _referenced_globals(value) -> dict:
    functions = []
    if isinstance(value, types.FunctionType):
        functions = [value]
    elif inspect.isclass(value) and value.__module__ == "__main__":
        functions = [v for v in vars(value).values() if isinstance(v, types.FunctionType)]
    out = {}
    for fn in functions:
        codes = [fn.__code__]
        while codes:
            code = codes.pop()
            for n in code.co_names:
                if n in fn.__globals__:
                    out[n] = fn.__globals__[n]
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def _type_name(value) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _reason(value) -> str:
    try:
        crossing.dumps(value, crossing.TO_RANK)
    except Exception as exc:  # whatever pickling raised is the reason shown
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return text[:200]
    return "it cannot be pickled"


def unship(blob: bytes, resolve: Callable[[str], object] | None = None,
           place: Callable[[str], str] | None = None) -> dict:
    """In the rank: the shipped values, in ONE namespace shared with the shipped functions.

    ``resolve`` finds what a :class:`StandIn` (a registered loader) stands for, by name;
    ``place`` where a notebook value recorded on a device lands (recorded device -> device:
    :func:`taas.job.devices.placement`; None: this process's rule).

    cloudpickle gives every notebook function pickled in one call the same reconstructed
    globals dict; running the cell in that very dict keeps notebook semantics (a function sees
    the cell's later rebinding of a global it reads).
    """
    with devices.placing(place):
        values = _StandInUnpickler(io.BytesIO(blob), resolve).load()
    namespace = None
    for value in values.values():
        g = _globals_of(value)
        if g is not None:
            namespace = g
            break
    if namespace is None:
        namespace = {}
    namespace.update(values)
    return namespace


def _globals_of(value):
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return value.__globals__
    if inspect.isclass(value) and value.__module__ == "__main__":
        for v in vars(value).values():
            if isinstance(v, types.FunctionType):
                return v.__globals__
    return None
