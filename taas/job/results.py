"""Rank 0's results, both ends: the one format of ``result.pkl``.

    rank 0   bound names, Out[] value ──collect (each pickled on its own)──> Results ──encode──> bytes
    kernel   bytes ──decode──> Results ──load (each unpickled on its own)──> CellResult

Rank 0 (:mod:`taas.rank.main`) collects and encodes when its cell ended; the launcher carries
the bytes back as :data:`taas.launch.api.RESULT`; the session (:mod:`taas.session`) decodes and
loads them into names, ``Out[]`` and notes for the notebook.  Nothing else knows the format.

Every value is pickled, and later unpickled, on its own: one that cannot travel costs that value
and one note line, never the job or the other values.  Wrappers bound to the job's process group
(DDP, Lightning Fabric's) come back as what they wrap (:mod:`taas.job.crossing`).  Tensors and
modules come back on the CPU (:func:`results_to_cpu`), so the kernel never holds a rank's GPU
memory after the job; ``--results-device keep`` keeps their device when the kernel has CUDA.

Big storages (1 MiB or more) do not go into the pickles when rank 0 has the job's results
channel (one machine): the kernel reads them out of rank 0's memory, once, while rank 0 waits
(or rank 0 hands them over as memory files where the kernel may not read it;
:mod:`taas.job.memory.returns`); ``Results.shared`` names them.  On a cluster they travel inline.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from taas.job import crossing, devices
from taas.job.memory import returns as shared_returns
from taas.job.memory.channel import ResultChannel, channel_from

__all__ = ["Before", "CellResult", "ResultChannel", "Results", "channel_from", "collect", "decode", "encode", "load",
           "results_to_cpu"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Results:
    """What rank 0 sends back: the wire value of ``result.pkl``."""

    values: Mapping[str, bytes] = field(default_factory=dict)  # name -> its own pickle
    skipped: Mapping[str, str] = field(default_factory=dict)  # name -> why it could not be pickled
    out: bytes | None = None  # the last expression's value, pickled; None: no Out[]
    out_skipped: str | None = None  # why the last expression's value could not be pickled
    lost: str | None = None  # set by decode(): why the whole file could not be read
    shared: bytes | None = None  # the token of rank 0's big storages on the results channel (returns.py)
    shared_count: int = 0  # how many big storages the values refer to


@dataclass(frozen=True)
class CellResult:
    """What the notebook gets from a job: the names to set, ``Out[]`` and one-line notes."""

    values: dict = field(default_factory=dict)  # names rank 0 bound, for the notebook
    out: object = None
    has_out: bool = False  # Out[] may be None itself: this says whether there is one
    notes: tuple[str, ...] = ()
    big: str = ""  # how rank 0's big storages came back, e.g. "2 storages, 1.00 GiB, read from rank 0's memory"


def results_to_cpu(results_device: str, kernel_cuda: int) -> bool:
    """Whether rank 0's tensors come back on the CPU: always, unless the cell asked to keep
    their device (``keep``) and the kernel sees ``kernel_cuda`` > 0 CUDA devices to hold them."""
    return results_device != "keep" or kernel_cuda <= 0


# -- rank 0 ------------------------------------------------------------------------------------
class _Held:
    """A value held by reference, for one that takes no weak reference (numbers, strings,
    builtin containers): the same interface as a weakref."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


class Before:
    """Rank 0's top-level names before its cell: afterwards, :meth:`bound` says which names the
    cell bound, however it bound them (an assignment, ``exec``, ``%run``, ``globals()[...] =``,
    ``from m import *``): those that are new or refer to another object than before (identity,
    not equality, so a mutated value the cell only read is not among them).

    Values are held by weak reference where they take one, so a value the cell rebinds is freed
    when the cell drops it, as it would be without taas; the others (numbers, strings, builtin
    containers) by reference, since an id alone may be reused by a new object."""

    def __init__(self, namespace: Mapping):
        self._held: dict[str, object] = {}
        for name, value in namespace.items():
            try:
                self._held[name] = weakref.ref(value)
            except TypeError:
                self._held[name] = _Held(value)

    def changed(self, name: str, value) -> bool:
        held = self._held.get(name)
        if held is None:
            return True
        old = held()  # type: ignore[operator]
        return old is not value or (old is None and isinstance(held, weakref.ref))

    def bound(self, namespace: Mapping, static: Iterable[str] = ()) -> list[str]:
        """The names to bring back: ``static`` (what the analysis saw the cell bind, as before)
        still in ``namespace``, then every other name the cell bound at run time; dunders never."""
        names = [name for name in static if name in namespace and not name.startswith("__")]
        seen = set(names)
        names += [name for name, value in namespace.items()
                  if name not in seen and not name.startswith("__") and self.changed(name, value)]
        return names


def collect(namespace: Mapping, bound: Iterable[str], out, *, to_cpu: bool,
            channel: int | None = None) -> Results:
    """The cell's top-level names ``bound`` (those ``namespace`` still holds; dunders never)
    and its last expression's value ``out`` (None: none), each pickled on its own.  With the
    job's results ``channel`` (an fd: :func:`channel_from`), the kernel reads big storages out
    of this process before this returns; if the channel is gone, everything is pickled inline."""
    sender = shared_returns.Returns(channel) if channel is not None else None
    values, skipped, out_blob, out_why = _pack_all(namespace, bound, out, to_cpu, sender)
    token, count = None, 0
    if sender is not None and sender.held:
        token, count, written = sender.token, len(sender.held), sender.written
        try:
            sender.send()
        except OSError as exc:  # the kernel is gone or its queue is full: the slow way
            log.debug("results channel refused %d storages (%s): pickled inline", count, exc)
            token, count = None, 0
            values, skipped, out_blob, out_why = _pack_all(namespace, bound, out, to_cpu, None)
        else:
            log.debug("results: %d storages (%d bytes) taken by the kernel", count, written)
    elif sender is not None:
        sender.close()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("results: %s; not brought back: %s; Out: %s",
                  ", ".join(f"{k} ({len(v)} bytes)" for k, v in values.items()) or "none",
                  ", ".join(skipped) or "none",
                  "none" if out_blob is None else f"{len(out_blob)} bytes")
    return Results(values=values, skipped=skipped, out=out_blob, out_skipped=out_why,
                   shared=token, shared_count=count)


def _pack_all(namespace: Mapping, bound: Iterable[str], out, to_cpu: bool, sender):
    values: dict[str, bytes] = {}
    skipped: dict[str, str] = {}
    for name in bound:
        if name.startswith("__") or name not in namespace:
            continue
        blob, why = _pack(namespace[name], to_cpu, sender)
        if blob is None:
            skipped[name] = why or ""  # _pack always says why
        else:
            values[name] = blob
    out_blob, out_why = (None, None) if out is None else _pack(out, to_cpu, sender)
    return values, skipped, out_blob, out_why


def encode(results: Results) -> bytes:
    return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)


def _pack(value, to_cpu: bool, sender=None) -> tuple[bytes | None, str | None]:
    """One result as bytes, or why it cannot come back.  Never raises (but for Ctrl-C): a
    value's failure to pickle -- whatever it raises, SystemExit included -- costs that value,
    never the job or the other values.  DistributedDataParallel and Lightning Fabric wrappers
    anywhere in the value come back as what they wrap (taas.job.crossing)."""
    kind = type(value).__qualname__
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(max(limit, crossing.RESULT_RECURSION_LIMIT))  # deeper: a note
        value = crossing.unwrap(value)
        kind = type(value).__qualname__
        if _holds_shards(value):
            return None, (f"{type(value).__qualname__} holds sharded DTensors that belong to the "
                          "job's process group; gather them in the cell (e.g. .full_tensor()) to bring them back")
        # Every CUDA storage anywhere in the value crosses once, as its bytes, landing on the
        # CPU (or its own device): tied weights stay tied, views stay views, optimizer state
        # follows; rank 0's own objects stay where they are.  Big ones (CPU ones too) go by
        # the results channel when there is a ``sender`` (taas.job.memory.returns).
        hook = devices.DeviceStorages(land="cpu" if to_cpu else "keep",
                                      copy_in=sender.copy_in if sender is not None else None,
                                      big=sender.reduce if sender is not None else None).reduce
        return crossing.dumps(value, crossing.TO_KERNEL, hook), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from a __reduce__ too: it ends nothing here
        if isinstance(exc, RecursionError) or isinstance(exc.__cause__, RecursionError):
            return None, f"{kind} is nested too deeply to pickle"
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        why = text if text and isinstance(exc, Exception) else f"{type(exc).__name__}: {text}".rstrip(": ")
        return None, f"{kind} cannot be pickled ({why})"
    finally:
        sys.setrecursionlimit(limit)


def _holds_shards(value) -> bool:
    """A module or optimizer over FSDP/DTensor parameters: its shards mean nothing outside."""
    torch = sys.modules.get("torch")
    if torch is None:  # a process that never imported torch holds no tensor
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return False
    if isinstance(value, DTensor):
        return True
    if isinstance(value, torch.nn.Module):
        return any(isinstance(p, DTensor) for p in value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for group in value.param_groups for p in group["params"])
    return False


# -- the kernel --------------------------------------------------------------------------------
def decode(data: bytes) -> Results:
    """``result.pkl``'s bytes as :class:`Results`.  Never raises (but for Ctrl-C): bytes that
    are not rank 0's results come back as a Results whose ``lost`` says why, so a damaged file
    costs the names, not the job's outcome."""
    try:
        results = pickle.loads(data)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # whatever unpickling raised: the file is unreadable, no more
        log.warning("rank 0's results are unreadable: %r", exc)
        return Results(lost=f"rank 0's results could not be read ({type(exc).__name__})")
    if not isinstance(results, Results):
        log.warning("rank 0's results are a %s, not Results", type(results).__qualname__)
        return Results(lost=f"rank 0's results could not be read (a {type(results).__qualname__})")
    return results


def load(results: Results, channel: ResultChannel | None = None) -> CellResult:
    """In the kernel: each value unpickled on its own, with a note for each that did not come
    back (on rank 0 or here).  Big storages are taken from the job's results ``channel`` (read
    from rank 0, or its files); a value whose storages did not arrive is a note too."""
    taken = None
    if results.shared is not None and channel is not None:
        taken = channel.take(results.shared, results.shared_count)
    try:
        with shared_returns.mapping(taken):
            got = _load(results)
        return got if not taken else dataclasses.replace(got, big=_how(taken))
    finally:
        for fd in taken or ():  # each storage made over a file keeps its own duplicate
            if isinstance(fd, int):
                os.close(fd)


def _how(taken: list) -> str:
    files = isinstance(taken[0], int)
    nbytes = sum(os.fstat(fd).st_size if files else fd.nbytes() for fd in taken)
    return (f"{len(taken)} {'storage' if len(taken) == 1 else 'storages'}, {nbytes / (1 << 30):.2f} GiB, "
            + ("as memory files" if files else "read from rank 0's memory"))


def _load(results: Results) -> CellResult:
    values: dict = {}
    notes: list[str] = []
    if results.lost:
        notes.append(f"taas: nothing was brought back: {results.lost}")
    for name, blob in results.values.items():
        value, why = crossing.load_result(blob)
        if why is None:
            values[name] = value
        else:
            notes.append(f"taas: `{name}` was not brought back: {why}")
    for name, why in results.skipped.items():
        notes.append(f"taas: `{name}` was not brought back: {why}")
    out, has_out = None, False
    if results.out is not None:
        value, why = crossing.load_result(results.out)
        if why is None:
            out, has_out = value, True
        else:
            notes.append(f"taas: the cell's result was not brought back: {why}")
    elif results.out_skipped:
        notes.append(f"taas: the cell's result was not brought back: {results.out_skipped}")
    return CellResult(values=values, out=out, has_out=has_out, notes=tuple(notes))
