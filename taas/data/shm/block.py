"""A channel's formats on the one-machine transport: its FIFO messages and its blocks.

Both ends of a channel (:mod:`taas.data.shm.ring`) speak these::

    data FIFO, producer -> consumer   MSG (kind, unit, block, aux), 32 bytes: DATA (unit in
                                      block), PASS_END (unit: the next pass's first, aux: the
                                      pass), RETIRE (block unlinked: unmap it)
    space FIFO, consumer -> producer  BACK (kind, block), 16 bytes: FREED (the block's tensors
                                      are garbage: reuse it), TAKEN (a wake-up)
    block                             BLOCK header (size, meta at, meta length, buffers, table
                                      at, blobs at), tensors collated in place, the pickled
                                      structure, the buffer table (ENTRY each), the blobs

A message either end cannot read is logged and ignored there (:func:`fits` checks a block's
header before a rank reads it).
"""

from __future__ import annotations

import mmap
import struct

from taas.data.transport import align

RETIRE = 9  # message kind: the producer unlinked a block; unmap it
FREED, TAKEN = 1, 2  # space messages
MSG = struct.Struct("<4Q")  # kind, unit, block, aux
BACK = struct.Struct("<2Q")  # kind, block
BLOCK = struct.Struct("<8Q")  # size, meta at, meta length, buffers, table at, blobs at
ENTRY = struct.Struct("<2Q")  # offset, nbytes of an out-of-band buffer


def size_class(n: int) -> int:
    """Block sizes: steps of 1/8 of the next power of two (at most 12.5% unused), whole pages."""
    n = max(n, 4096)
    step = max(4096, (1 << (n - 1).bit_length()) // 8)
    return (n + step - 1) // step * step


class Block:
    """A block as its producer holds it: mapped, with a byte view for writing tensors."""

    __slots__ = ("id", "size", "name", "mm", "u8", "address")

    def __init__(self, block_id: int, size: int, name: str, mm: mmap.mmap):
        import torch

        self.id, self.size, self.name, self.mm = block_id, size, name, mm
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8)
        self.address = self.u8.data_ptr()


class Draft:
    """A block lent to a collate function before the unit exists: ``alloc`` hands out tensors
    in it, so the collated batch is written where the rank will read it (no second copy)."""

    def __init__(self, block: Block):
        self.block = block
        self.top = BLOCK.size

    def alloc(self, nbytes: int, dtype, shape):
        start = align(self.top)
        if nbytes <= 0 or start + nbytes > self.block.size:
            return None
        self.top = start + nbytes
        return self.block.u8[start:start + nbytes].view(dtype).view(shape)


def fits(mm: mmap.mmap) -> bool:
    """A block's header describes parts inside the block."""
    size, meta_at, meta_len, nbuf, table_at, blob = struct.unpack_from("<6Q", mm, 0)
    return (size <= len(mm) and meta_at + meta_len <= size and table_at + ENTRY.size * nbuf <= size
            and blob <= size)


def close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # tensors still view it; it goes when they do
        pass
