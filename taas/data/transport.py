"""How units travel from a loader worker to a rank: the contract, and the unit codec.

The contract is one channel per (worker, rank) pair, a bounded FIFO of records in unit order::

    producer side                              consumer side
    Sender.put(unit, value) -> bool            Receiver.peek() -> Header   (waits for a record)
        blocks while the channel is full;      Receiver.take() -> (value, nbytes)   a DATA record
        False: the consumer has gone           Receiver.skip()                      a PASS_END
    Sender.end_pass(pass_index, end_unit)      Receiver.close()   (the producer stops sending)
    Sender.close()

On one machine :mod:`taas.data.shm` implements it with a ring per pair in a shared-memory
segment; a multi-node transport implements the same two classes.

The codec keeps tensors out of pickle: :func:`encode` pickles a unit's structure (tuples,
lists, dicts, namedtuples, dataclasses, strings, numbers, ...) with cloudpickle, replacing each
CPU tensor by a persistent id that says where its bytes go; contiguous numpy arrays travel as
pickle-5 out-of-band buffers the same way.  How the bytes travel is the transport's business
(:mod:`taas.data.shm`: copied once, by the producer; the rank's tensors view them).
"""

from __future__ import annotations

import abc
import functools
import io
import pickle
from dataclasses import dataclass, field
from typing import NamedTuple

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
