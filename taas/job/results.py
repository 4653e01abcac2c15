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
"""

from __future__ import annotations

import logging
import pickle
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from taas.job import crossing, devices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Results:
    """What rank 0 sends back: the wire value of ``result.pkl``."""

    values: Mapping[str, bytes] = field(default_factory=dict)  # name -> its own pickle
    skipped: Mapping[str, str] = field(default_factory=dict)  # name -> why it could not be pickled
    out: bytes | None = None  # the last expression's value, pickled; None: no Out[]
    out_skipped: str | None = None  # why the last expression's value could not be pickled
    lost: str | None = None  # set by decode(): why the whole file could not be read


@dataclass(frozen=True)
class CellResult:
    """What the notebook gets from a job: the names to set, ``Out[]`` and one-line notes."""

    values: dict = field(default_factory=dict)  # names rank 0 bound, for the notebook
    out: object = None
    has_out: bool = False  # Out[] may be None itself: this says whether there is one
    notes: tuple[str, ...] = ()


def results_to_cpu(results_device: str, kernel_cuda: int) -> bool:
    """Whether rank 0's tensors come back on the CPU: always, unless the cell asked to keep
    their device (``keep``) and the kernel sees ``kernel_cuda`` > 0 CUDA devices to hold them."""
    return results_device != "keep" or kernel_cuda <= 0


# -- rank 0 ------------------------------------------------------------------------------------
def collect(namespace: Mapping, bound: Iterable[str], out, *, to_cpu: bool) -> Results:
    """The cell's top-level names ``bound`` (those ``namespace`` still holds; dunders never)
    and its last expression's value ``out`` (None: none), each pickled on its own."""
    values: dict[str, bytes] = {}
    skipped: dict[str, str] = {}
    for name in bound:
        if name.startswith("__") or name not in namespace:
            continue
        blob, why = _pack(namespace[name], to_cpu)
        if blob is None:
            skipped[name] = why or ""  # _pack always says why
        else:
            values[name] = blob
    out_blob, out_why = (None, None) if out is None else _pack(out, to_cpu)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("results: %s; not brought back: %s; Out: %s",
                  ", ".join(f"{k} ({len(v)} bytes)" for k, v in values.items()) or "none",
                  ", ".join(skipped) or "none",
                  "none" if out_blob is None else f"{len(out_blob)} bytes")
    return Results(values=values, skipped=skipped, out=out_blob, out_skipped=out_why)


def encode(results: Results) -> bytes:
    return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)


def _pack(value, to_cpu: bool) -> tuple[bytes | None, str | None]:
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
        # follows; rank 0's own objects stay where they are.
        hook = devices.DeviceStorages(land="cpu" if to_cpu else "keep").reduce
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


def load(results: Results) -> CellResult:
    """In the kernel: each value unpickled on its own, with a note for each that did not come
    back (on rank 0 or here)."""
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
