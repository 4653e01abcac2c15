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


class _Encoder(cloudpickle.Pickler):
    def __init__(self, file, out: Encoded):
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self._out = out
        self._tensor = _torch().Tensor

    def _place(self, nbytes: int) -> int:
        offset = self._out.nbytes
        self._out.nbytes += align(nbytes)
        return offset

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
        offset = self._place(nbytes)
        self._out.blobs.append((offset, nbytes, t))
        return ("t", str(t.dtype).rpartition(".")[2], tuple(t.shape), offset, nbytes,
                bool(obj.requires_grad))

    def _buffer(self, buffer: pickle.PickleBuffer):
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: pickle it in-band
            return True
        offset = self._place(raw.nbytes)
        self._out.blobs.append((offset, raw.nbytes, raw))
        self._out.buffers.append((offset, raw.nbytes))
        return False


def encode(value) -> Encoded:
    """A unit as (pickled structure, blobs to place at offsets of its blob area)."""
    out = Encoded(b"")
    f = io.BytesIO()
    _Encoder(f, out).dump(value)
    out.meta = f.getvalue()
    return out


class _Decoder(pickle.Unpickler):
    def __init__(self, file, buffers, tensor_at):
        super().__init__(file, buffers=buffers)
        self._tensor_at = tensor_at

    def persistent_load(self, pid):
        torch = _torch()
        _, dtype, shape, offset, nbytes, requires_grad = pid
        dtype = getattr(torch, dtype)
        t = self._tensor_at(offset, nbytes, dtype, shape) if nbytes else torch.empty(shape, dtype=dtype)
        if requires_grad:
            t.requires_grad_(True)
        return t


def decode(meta: bytes, buffers: list, tensor_at):
    """Rebuild a unit: ``tensor_at(offset, nbytes, dtype, shape)`` returns the tensor whose bytes
    are at ``offset`` of the blob area; ``buffers`` are the out-of-band buffers."""
    return _Decoder(io.BytesIO(meta), buffers, tensor_at).load()
