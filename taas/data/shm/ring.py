"""The one-machine transport: units in pooled shared-memory blocks, lent to the ranks.

A channel's producer (a loader worker) writes each unit into a *block*, a shared-memory segment
``taas-<job>-<loader>-c<channel>-b<n>`` it created, and sends a 32-byte message naming the block
through the channel's ``data`` FIFO.  The consumer (a rank) maps the block (once; blocks are
reused) and builds the unit's tensors *over the block* -- no copy on the rank side (units under
64 KiB are copied: cheap, and a rank that keeps thousands of them then pins no blocks).  When the
last of them is garbage, the block goes back to the producer's pool (a message on the ``space``
FIFO) and is reused without page faults.  A default-collated batch is stacked straight into its
block (a :class:`Draft`), so a unit's bytes are written once, by the producer.

Bounded: the producer waits while the bytes *in flight* (sent, not yet taken by the rank) would
exceed the channel's bound, or 256 messages are in flight.  What a rank keeps after taking it is
its own memory (the pool grows rather than the channel deadlocking); free blocks beyond the
bound are retired.  The counters both sides read live in the loader's header segment
(:mod:`taas.data.shm.segment`).

Block: a 64-byte header (size and where the parts are), tensors a collate function wrote in
place, the pickled structure, the buffer table, then the copied blobs, 64-byte aligned (the formats:
:mod:`taas.data.shm.block`; a message the other end did not send is logged and ignored).  A side
about to wait drains its FIFO, checks the counters again, then sleeps in ``select``; a full FIFO
means the other side has bytes to read, so no wake-up is lost.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import weakref

from taas.data.shm.block import (
    BACK, BLOCK, ENTRY, FREED, MSG, RETIRE, TAKEN, Block, Draft, close_quietly, fits, size_class,
)
from taas.data.shm.segment import (
    C_CLOSED, C_PID, C_SENT_BYTES, C_SENT_MSGS, C_TAKEN_BYTES, C_TAKEN_MSGS, C_UNITS, C_WAITING,
    Segment, _alive, _open_fifo, _read_all, _shm_attach, _shm_create, block_name, unlink,
)
from taas.data.transport import DATA, PASS_END, Header, Receiver, Sender, align, decode, encode
from taas import ready

log = logging.getLogger("taas")

MAX_IN_FLIGHT = 256  # messages per channel (the data FIFO holds 2048)
COPY_BELOW = 64 * 1024  # units this small are copied out of their block (cheap), not lent


class ShmSender(Sender):
    """The producer end of one channel.  ``on_wait(True/False)`` brackets waiting for space."""

    def __init__(self, seg: Segment, channel: int, fifos: tuple[str, str], on_wait=None):
        self.seg, self.ch = seg, channel
        self.bound = seg.layout.bound
        self.data_fd, self.space_fd = _open_fifo(fifos[0]), _open_fifo(fifos[1])
        self.on_wait = on_wait
        self.sent_msgs = self.sent_bytes = self.units = 0
        self.blocks: dict[int, Block] = {}
        self.free: list[Block] = []
        self.lent: set[int] = set()  # blocks sent and not yet FREED by the consumer
        self.last_size = 0  # of the last unit: the size of the next draft
        self._next_id = 0
        self._back = b""
        self._gone = False

    # -- consumer state --------------------------------------------------------------------
    @property
    def gone(self) -> bool:
        if not self._gone:
            pid = self.seg.channel(self.ch, C_PID)
            self._gone = bool(self.seg.channel(self.ch, C_CLOSED)) or (pid != 0 and not _alive(pid))
        return self._gone

    def _collect(self) -> None:
        """Read what the consumer sent back: freed blocks return to the pool."""
        data = self._back + _read_all(self.space_fd)
        whole = len(data) - len(data) % BACK.size
        self._back = data[whole:]
        for kind, block_id in BACK.iter_unpack(data[:whole]):
            if kind == FREED and block_id in self.lent:  # once per send: a repeat would lend it twice
                self.lent.discard(block_id)
                self.free.append(self.blocks[block_id])
            elif kind == FREED or kind != TAKEN:
                log.warning("taas data plane: a loader worker ignored a space message (%d, %d) on channel %d",
                            kind, block_id, self.ch)

    def _room(self, size: int) -> bool:
        seg, ch = self.seg, self.ch
        in_flight = self.sent_bytes - seg.channel(ch, C_TAKEN_BYTES)
        msgs = self.sent_msgs - seg.channel(ch, C_TAKEN_MSGS)
        return msgs < MAX_IN_FLIGHT and (in_flight == 0 or in_flight + size <= self.bound)

    def _wait(self, size: int) -> bool:
        if self._room(size):
            return True
        if self.on_wait:
            self.on_wait(True)
        try:
            while True:
                if self.gone:
                    return False
                self.seg.set_channel(self.ch, C_WAITING, 1)
                self._collect()
                if self._room(size):
                    return True
                _wait(self.space_fd, 0.1)
        finally:
            self.seg.set_channel(self.ch, C_WAITING, 0)
            if self.on_wait:
                self.on_wait(False)

    # -- blocks ----------------------------------------------------------------------------
    def _block(self, size: int) -> Block:
        self._collect()
        want = size_class(size)
        best = None
        for block in self.free:
            if want <= block.size <= 2 * want and (best is None or block.size < best.size):
                best = block
        if best is not None:
            self.free.remove(best)
            return best
        self._trim(want)
        block_id = self._next_id
        self._next_id += 1
        name = block_name(self.seg.name, self.ch, block_id)
        block = self.blocks[block_id] = Block(block_id, want, name, _shm_create(name, want))
        return block

    def _trim(self, adding: int) -> None:
        """Keep the pool's free blocks under the bound: retire the largest beyond it."""
        free_bytes = sum(b.size for b in self.free)
        while self.free and free_bytes + adding > self.bound:
            block = max(self.free, key=lambda b: b.size)
            self.free.remove(block)
            free_bytes -= block.size
            del self.blocks[block.id]
            unlink(block.name)
            self._send(RETIRE, 0, block.id, 0, 0)
            block.u8 = None
            try:
                block.mm.close()
            except BufferError:
                pass

    # -- sending ---------------------------------------------------------------------------
    def draft(self) -> Draft | None:
        """A block for the next unit to be collated into (sized like the last unit)."""
        if self.gone or not self.last_size:
            return None
        return Draft(self._block(self.last_size))

    def put(self, unit: int, value, draft: Draft | None = None) -> bool:
        if self.gone:
            if draft is not None:
                self.free.append(draft.block)
            return False
        enc = encode(value, (draft.block.address, draft.block.size) if draft else None)

        def write(block: Block, blob_at: int) -> None:
            mm, u8 = block.mm, block.u8
            for offset, nbytes, src in enc.blobs:
                if not nbytes:
                    continue
                lo = blob_at + offset
                if isinstance(src, memoryview):
                    mm[lo:lo + nbytes] = src
                else:
                    u8[lo:lo + nbytes].view(src.dtype).view(src.shape).copy_(src)

        return self._put(unit, enc.meta, enc.buffers, enc.nbytes, write, draft)

    def put_raw(self, unit: int, meta: bytes, buffers: list, nbytes: int, write) -> bool:
        """Send a unit encoded elsewhere (:func:`encode` ran in another process): ``meta`` and
        ``buffers`` as :class:`Encoded` has them, a blob area of ``nbytes``; ``write(mm,
        blob_at)`` fills the blob area of block ``mm`` from ``blob_at`` on (a relay receives the
        bytes from its socket straight into the block).  Not called when the consumer is gone."""
        if self.gone:
            return False
        return self._put(unit, meta, buffers, nbytes, lambda block, at: write(block.mm, at), None)

    def _put(self, unit: int, meta: bytes, buffers: list, nbytes: int, write, draft: Draft | None) -> bool:
        top = draft.top if draft else BLOCK.size
        meta_at = align(top)
        table_at = meta_at + (len(meta) + 7) // 8 * 8
        blob_at = align(table_at + ENTRY.size * len(buffers))
        size = blob_at + nbytes
        if not self._wait(size):
            if draft is not None:
                self.free.append(draft.block)
            return False
        if draft is not None and size <= draft.block.size:
            block = draft.block
        else:
            block = self._block(size)
            if draft is not None:  # outgrew its draft: move what was collated there
                block.mm[BLOCK.size:top] = draft.block.mm[BLOCK.size:top]
                self.free.append(draft.block)
        mm = block.mm
        BLOCK.pack_into(mm, 0, size, meta_at, len(meta), len(buffers), table_at, blob_at, 0, 0)
        mm[meta_at:meta_at + len(meta)] = meta
        for j, (offset, length) in enumerate(buffers):
            ENTRY.pack_into(mm, table_at + ENTRY.size * j, offset, length)
        write(block, blob_at)
        self.units += 1
        self.last_size = size
        self.seg.set_channel(self.ch, C_UNITS, self.units)
        self.lent.add(block.id)
        self._send(DATA, unit, block.id, 0, size)
        return True

    def end_pass(self, pass_index: int, end_unit: int) -> bool:
        if self.gone or not self._wait(0):
            return False
        self._send(PASS_END, end_unit, 0, pass_index, 0)
        return True

    def _send(self, kind: int, unit: int, block: int, aux: int, size: int) -> None:
        self.sent_msgs += 1
        self.sent_bytes += size
        self.seg.set_channel(self.ch, C_SENT_BYTES, self.sent_bytes)
        self.seg.set_channel(self.ch, C_SENT_MSGS, self.sent_msgs)
        os.write(self.data_fd, MSG.pack(kind, unit, block, aux))  # < MAX_IN_FLIGHT: never full

    def close(self) -> None:
        for fd in (self.data_fd, self.space_fd):
            os.close(fd)


class ShmReceiver(Receiver):
    """The consumer end of one channel.  Tensors are views of the producer's block (or, with
    ``pin_memory``, copies in pinned memory); the block goes back when they are all garbage."""

    def __init__(self, seg: Segment, channel: int, fifos: tuple[str, str], pin_memory: bool = False):
        self.seg, self.ch = seg, channel
        self.pin = pin_memory
        self.data_fd, self.space_fd = _open_fifo(fifos[0]), _open_fifo(fifos[1])
        self.taken_msgs = seg.channel(channel, C_TAKEN_MSGS)
        self.taken_bytes = seg.channel(channel, C_TAKEN_BYTES)
        self.blocks: dict[int, mmap.mmap] = {}
        self._inbox = b""
        self._cur = None
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._closed = False
        seg.set_channel(channel, C_PID, os.getpid())

    def peek(self) -> Header:
        if self._cur is None:
            self._cur = self._next()
        kind, unit, _, aux = self._cur
        return Header(kind, unit, aux)

    def _next(self):
        while True:
            if len(self._inbox) < MSG.size:
                self._inbox += _read_all(self.data_fd)
            if len(self._inbox) >= MSG.size:
                msg = MSG.unpack_from(self._inbox)
                self._inbox = self._inbox[MSG.size:]
                if msg[0] == RETIRE:
                    mm = self.blocks.pop(msg[2], None)
                    if mm is not None:
                        close_quietly(mm)
                    self._taken(0)
                    continue
                if msg[0] == PASS_END or (msg[0] == DATA and self._block(msg[2]) is not None):
                    return msg
                # Not counted as taken: it is not the producer's (every one of those reads).
                log.warning("taas data plane: a rank ignored a message (%d, %d, %d, %d) on channel %d",
                            *msg, self.ch)
                continue
            if self._closed:  # the view is done (a kept rank's cell ended): nothing more comes
                raise EOFError(f"channel {self.ch} was closed")
            self._back(None)  # retry what the producer had no room for
            _wait(self.data_fd, 0.5)

    def take(self):
        kind, _, block_id, _ = self._cur or self._next()
        self._cur = None
        assert kind == DATA, kind
        mm = self.blocks[block_id]  # mapped and checked by _next
        size, meta_at, meta_len, nbuf, table_at, blob = struct.unpack_from("<6Q", mm, 0)
        meta = bytes(mm[meta_at:meta_at + meta_len])
        table = [ENTRY.unpack_from(mm, table_at + ENTRY.size * j) for j in range(nbuf)]
        buffers = [bytearray(mm[blob + off:blob + off + n]) for off, n in table]
        lease = memoryview(mm)
        lent = []
        copy = self.pin or size <= COPY_BELOW  # small units are copied: kept ones pin no block

        def tensor_at(offset: int, nbytes: int, dtype, shape, in_place: bool):
            import torch

            start = offset if in_place else blob + offset
            t = torch.frombuffer(lease, dtype=dtype, count=nbytes // _itemsize(dtype), offset=start)
            if copy:
                t = t.pin_memory() if self.pin else t.clone()
            else:
                lent.append(True)
            return t.view(shape)

        value = decode(meta, buffers, tensor_at)
        self._taken(size)
        if lent:
            weakref.finalize(lease, self._free, block_id)
        else:
            self._free(block_id)
        return value, size

    def _block(self, block_id: int) -> mmap.mmap | None:
        """Block ``block_id`` mapped, if it exists and its header (rewritten per unit) describes
        parts inside it; else None."""
        mm = self.blocks.get(block_id)
        if mm is None:
            try:
                mm = _shm_attach(block_name(self.seg.name, self.ch, block_id))
            except OSError:  # no such block: the message did not come from the producer
                return None
            if len(mm) < BLOCK.size:
                close_quietly(mm)
                return None
            self.blocks[block_id] = mm
        return mm if fits(mm) else None

    def skip(self) -> None:
        kind, *_ = self._cur or self._next()
        self._cur = None
        assert kind == PASS_END, kind
        self._taken(0)

    def _taken(self, size: int) -> None:
        self.taken_msgs += 1
        self.taken_bytes += size
        self.seg.set_channel(self.ch, C_TAKEN_BYTES, self.taken_bytes)
        self.seg.set_channel(self.ch, C_TAKEN_MSGS, self.taken_msgs)
        self._back(BACK.pack(TAKEN, 0))

    def _free(self, block_id: int) -> None:  # may run in any thread (garbage collection)
        self._back(BACK.pack(FREED, block_id))

    def _back(self, message: bytes | None) -> None:
        with self._lock:
            if self._closed:
                return
            if message is not None:
                self._pending.append(message)
            while self._pending:
                try:
                    os.write(self.space_fd, self._pending[0])
                except BlockingIOError:  # the producer is busy; it drains the FIFO when it waits
                    if BACK.unpack(self._pending[-1])[0] == TAKEN:
                        self._pending.pop()  # wake-ups need not queue
                    return
                self._pending.pop(0)

    def close(self) -> None:
        """The rank is done: the producer stops sending.  The FIFOs stay open until the process
        exits (a reader thread may still be inside peek(); a closed fd number could be reused)."""
        self.seg.set_channel(self.ch, C_CLOSED, 1)
        with self._lock:
            self._closed = True
        try:
            os.write(self.space_fd, BACK.pack(TAKEN, 0))
        except OSError:  # full (the producer drains it when it waits), or released already
            pass

    def release(self) -> None:
        """After :meth:`close`, with no reader left inside: the FIFOs closed, the blocks
        unmapped (a block the rank's tensors still view goes when they do)."""
        with self._lock:
            self._closed = True
            fds, self.data_fd, self.space_fd = (self.data_fd, self.space_fd), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        while self.blocks:
            close_quietly(self.blocks.popitem()[1])


def _itemsize(dtype) -> int:
    return dtype.itemsize


def _wait(fd: int, timeout: float) -> None:
    """Until ``fd`` can be read, at most ``timeout`` s (taas.ready: poll(2), as a rank of a
    large job holds descriptors numbered past 1023)."""
    ready.wait_readable(fd, timeout)
