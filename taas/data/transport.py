"""How units travel from a loader worker to a rank: the transport contract, and the unit codec.

A *transport* moves one job's units and keeps its control state.  The session picks it
(``taas.session.transport_for`` reads the launcher's ``topology()``), so a cross-machine
transport can replace shared memory without views, workers or plans changing.  Three sides::

    kernel (plane.py), one per job           Transport(job_id)
        .channels(loader, workers, pairs, buffer_bytes) -> Address   one loader's channels
        .control(loader) -> ControlState     workers' state, ranks' wanted units (hang report)
        .processes(env) -> [ProcessSpec]     job processes it needs (relays), or none
        .close()                             release everything (the job is over)
        .cleanup() -> (entry, args)          a hook that frees the job's resources from another
                                             process (the launcher's, when the kernel died)
    loader worker (loader_worker.py)         attach(address) -> Endpoint
        .sender(channel, on_wait) -> Sender  the producer end of a (worker, rank) channel
        .worker(w) -> WorkerControl          state and unit, units produced, first slice ready
    rank (view.py)                           attach(address) -> Endpoint
        .receiver(channel, pin) -> Receiver  the consumer end
        .want(channel, unit), .prefetched(w) the unit it waits for; the workers' readiness

The :class:`Address` is small and picklable: it travels in the workers' and ranks' settings and
names the :class:`Endpoint` class that reads it.  Channels are numbered as the plan numbers
(worker, rank) pairs; ``control`` states are :data:`STARTING` ... :data:`DONE`.

A channel is a bounded FIFO of records in unit order::

    producer side                              consumer side
    Sender.put(unit, value) -> bool            Receiver.peek() -> Header   (waits for a record)
        blocks while the channel is full;      Receiver.take() -> (value, nbytes)   a DATA record
        False: the consumer has gone           Receiver.skip()                      a PASS_END
    Sender.end_pass(pass_index, end_unit)      Receiver.close()   (the producer stops sending)
    Sender.close()

On one machine :mod:`taas.data.shm.transport` implements it (a ring of pooled shared-memory
blocks per pair, :mod:`taas.data.shm.ring`; control words in a header segment per loader,
:mod:`taas.data.shm.segment`).  Across machines :mod:`taas.data.tcp.transport` does: one TCP
stream per (loader worker, GPU node) into a relay that fills that node's shared-memory rings.

The codec keeps tensors out of pickle: :func:`encode` pickles a unit's structure (tuples,
lists, dicts, namedtuples, dataclasses, strings, numbers, ...) with cloudpickle, replacing each
CPU tensor by a persistent id that says where its bytes go; contiguous numpy arrays travel as
pickle-5 out-of-band buffers the same way.  How the bytes travel is the transport's business
(:mod:`taas.data.shm.ring`: copied once, by the producer; the rank's tensors view them).
"""

from __future__ import annotations

import abc
import functools
import importlib
import io
import pickle
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import cloudpickle

ALIGN = 64

DATA, PASS_END = 1, 2


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Header(NamedTuple):
    kind: int  # DATA or PASS_END
    unit: int  # DATA: the unit's number; PASS_END: the first unit of the next pass
    aux: int  # PASS_END: the pass that ended


class Sender(abc.ABC):
    @abc.abstractmethod
    def put(self, unit: int, value) -> bool:
        """Send ``value`` as ``unit``; blocks while the channel is full.  False when the
        consumer has gone (closed or exited): the unit was dropped."""

    @abc.abstractmethod
    def end_pass(self, pass_index: int, end_unit: int) -> bool:
        """Tell the consumer that pass ``pass_index`` ended before unit ``end_unit``."""

    @property
    @abc.abstractmethod
    def gone(self) -> bool:
        """The consumer has gone; nothing more needs sending."""

    def close(self) -> None:
        pass


class Receiver(abc.ABC):
    @abc.abstractmethod
    def peek(self) -> Header:
        """The next record's header, waiting for one to arrive."""

    @abc.abstractmethod
    def take(self):
        """Consume the next record, a DATA one: (value, bytes moved)."""

    @abc.abstractmethod
    def skip(self) -> None:
        """Consume the next record, a PASS_END one."""

    def close(self) -> None:
        pass

    def release(self) -> None:
        """Free what the receiver holds (fds, mappings), after :meth:`close` and once no thread
        is inside :meth:`peek` or :meth:`take` any more (a kept rank's view at its cell's end;
        a process that exits needs none of it)."""


# -- the transport ---------------------------------------------------------------------------
STARTING, LOADING, BLOCKED, DONE = range(4)  # a loader worker's state
STATE_NAMES = {STARTING: "starting", LOADING: "loading", BLOCKED: "waiting for buffer space", DONE: "done"}

Hook = tuple  # (entry "module:function", args tuple): function(*args) frees a job's resources


def resolve(name: str):
    """The object ``"package.module:attr"`` names (a transport class, an endpoint class)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Address:
    """Where one loader's channels are, for the processes that attach to them: ``endpoint``
    names the :class:`Endpoint` class (``"module:Class"``), ``where`` is its own (picklable,
    small: it travels in every worker's and rank's settings)."""

    endpoint: str
    where: object


@dataclass(frozen=True)
class WorkerStatus:
    state: int  # STARTING, LOADING, BLOCKED or DONE
    unit: int  # the unit it loads (LOADING) or waits to send (BLOCKED)
    busy_s: float  # seconds since it entered that state
    prefetched: bool  # its first slice is ready
    produced: int  # units sent so far


@dataclass(frozen=True)
class ControlState:
    """One loader's control state as the kernel reads it (progress, hang reports)."""

    workers: list  # WorkerStatus per worker
    wanted: dict  # channel -> (unit, seconds waited) for each rank waiting for a unit


class Transport(abc.ABC):
    """The kernel side of a job's transport: makes the channels, reads the control state,
    releases it all.  One per job (``Transport(job_id)``)."""

    def __init__(self, job_id: str):
        self.job_id = job_id

    @abc.abstractmethod
    def channels(self, loader: int, workers: int, pairs: Sequence[tuple[int, int]],
                 buffer_bytes: int) -> Address:
        """Create loader ``loader``'s control state for ``workers`` workers and one channel per
        (worker, rank) pair of ``pairs`` (channel i is ``pairs[i]``), bounded to
        ``buffer_bytes`` in flight in all; the address its processes attach with."""

    @abc.abstractmethod
    def control(self, loader: int) -> ControlState:
        """What loader ``loader``'s workers are doing now, and which ranks wait for a unit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything of the job (the job is over).  Idempotent."""

    def fail(self, loader: int, worker: int, text: str) -> None:
        """Loader ``loader``'s worker ``worker`` failed (``text``: one line): ranks that read
        the loader see it (:meth:`Endpoint.failure`) and raise it in their cell.  Kept ranks
        need it, since a cell's failure must not stop them; one-cell jobs are stopped instead.
        Default: not told (the ranks then wait for units until the cell is stopped)."""

    def processes(self, env: dict) -> list:
        """Job processes the transport itself needs (``ProcessSpec``s, started with the loader
        workers once every loader's channels are made): none on one machine; the TCP transport's
        relays, one per GPU node."""
        return []

    @abc.abstractmethod
    def cleanup(self) -> Hook:
        """A picklable ``(entry, args)`` whose ``entry(*args)``, run in another process, frees
        what :meth:`close` would: the launcher runs it if the kernel cannot (it died)."""


class WorkerControl(abc.ABC):
    """A loader worker's control state, which the kernel and the ranks read."""

    @abc.abstractmethod
    def set_state(self, state: int, unit: int = 0) -> None:
        """Entering ``state`` (LOADING, BLOCKED, DONE) about ``unit``; its clock starts now."""

    @abc.abstractmethod
    def produced(self, count: int) -> None:
        """``count`` units sent so far."""

    @abc.abstractmethod
    def prefetched(self) -> None:
        """The first slice is ready: ranks may start."""


class Endpoint(abc.ABC):
    """A loader worker's or a rank's attachment to one loader's channels (:func:`attach`).
    Whatever it maps or opens lives as long as the process, or until :meth:`close`."""

    def __init__(self, address: Address):
        self.address = address

    # worker side
    @abc.abstractmethod
    def sender(self, channel: int, on_wait: Callable[[bool], None] | None = None) -> Sender:
        """The producer end of ``channel``; ``on_wait(True/False)`` brackets waiting for space."""

    @abc.abstractmethod
    def worker(self, worker: int) -> WorkerControl:
        """Where loader worker ``worker`` reports its state."""

    # rank side
    @abc.abstractmethod
    def receiver(self, channel: int, pin_memory: bool = False) -> Receiver:
        """The consumer end of ``channel`` (``pin_memory``: tensors arrive in pinned memory)."""

    @abc.abstractmethod
    def want(self, channel: int, unit: int | None) -> None:
        """The rank on ``channel`` waits for ``unit`` now (None: it no longer waits)."""

    @abc.abstractmethod
    def prefetched(self, worker: int) -> bool:
        """Worker ``worker`` has its first slice ready."""

    def failure(self) -> str | None:
        """The line the kernel gave when one of this loader's workers failed
        (:meth:`Transport.fail`), or None."""
        return None

    def close(self) -> None:
        pass


def attach(address: Address) -> Endpoint:
    """A job process's endpoint for ``address`` (made by the kernel's :class:`Transport`)."""
    return resolve(address.endpoint)(address)


# -- codec -----------------------------------------------------------------------------------
@dataclass
class Encoded:
    meta: bytes  # the pickled structure
    blobs: list = field(default_factory=list)  # (offset, nbytes, tensor or memoryview)
    buffers: list = field(default_factory=list)  # (offset, nbytes) of out-of-band buffers, in order
    nbytes: int = 0  # size of the blob area (aligned)


def _torch():
    import torch

    return torch


def _place(out: Encoded, nbytes: int) -> int:
    offset = out.nbytes
    out.nbytes += align(nbytes)
    return offset


def _buffer(out: Encoded, buffer: pickle.PickleBuffer) -> bool:
    try:
        raw = buffer.raw()
    except BufferError:  # not contiguous: pickle it in-band
        return True
    offset = _place(out, raw.nbytes)
    out.blobs.append((offset, raw.nbytes, raw))
    out.buffers.append((offset, raw.nbytes))
    return False


class _Encoder(cloudpickle.Pickler):
    def __init__(self, file, out: Encoded, in_place: tuple[int, int] | None):
        # Not buffer_callback=self._method: the pickler would reference itself, and the cycle
        # would keep every unit's tensors alive until the garbage collector runs (each new batch
        # then page-faults fresh memory: 3x slower collation).
        super().__init__(file, protocol=5, buffer_callback=functools.partial(_buffer, out))
        self._out = out
        self._tensor = _torch().Tensor
        self._in_place = in_place

    def persistent_id(self, obj):
        if type(obj) is not self._tensor:
            return None
        torch = _torch()
        if obj.layout != torch.strided or obj.device.type != "cpu" or obj.is_quantized or obj.is_nested:
            return None  # pickled by value, as torch pickles it
        t = obj.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).rpartition(".")[2]
        if self._in_place is not None and nbytes and t.is_contiguous():
            base, size = self._in_place
            offset = t.data_ptr() - base
            if 0 <= offset and offset + nbytes <= size:  # already where it must go: no copy
                return ("t", dtype, tuple(t.shape), offset, nbytes, bool(obj.requires_grad), True)
        offset = _place(self._out, nbytes)
        self._out.blobs.append((offset, nbytes, t))
        return ("t", dtype, tuple(t.shape), offset, nbytes, bool(obj.requires_grad), False)


def encode(value, in_place: tuple[int, int] | None = None) -> Encoded:
    """A unit as (pickled structure, blobs to place at offsets of its blob area).  Tensors whose
    bytes already lie in ``in_place`` = (address, size) -- the transport's own memory, where a
    collate function wrote them -- are referenced by their offset there instead."""
    out = Encoded(b"")
    f = io.BytesIO()
    _Encoder(f, out, in_place).dump(value)
    out.meta = f.getvalue()
    return out


class _Decoder(pickle.Unpickler):
    def __init__(self, file, buffers, tensor_at):
        super().__init__(file, buffers=buffers)
        self._tensor_at = tensor_at

    def persistent_load(self, pid):
        torch = _torch()
        _, dtype, shape, offset, nbytes, requires_grad, in_place = pid
        dtype = getattr(torch, dtype)
        if nbytes:
            t = self._tensor_at(offset, nbytes, dtype, shape, in_place)
        else:
            t = torch.empty(shape, dtype=dtype)
        if requires_grad:
            t.requires_grad_(True)
        return t


def decode(meta: bytes, buffers: list, tensor_at):
    """Rebuild a unit: ``tensor_at(offset, nbytes, dtype, shape, in_place)`` returns the tensor
    whose bytes are at ``offset`` of the blob area (``in_place``: of the transport's memory);
    ``buffers`` are the out-of-band buffers."""
    return _Decoder(io.BytesIO(meta), buffers, tensor_at).load()
