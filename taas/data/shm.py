"""The one-machine transport: units in pooled shared-memory blocks, lent to the ranks.

Per loader per job, a header segment ``/dev/shm/taas-<job>-<loader>`` (created by the kernel)
holds the workers' status and one pair of counter lines per channel.  A channel's producer
(the loader worker) writes each unit into a *block*, a shared-memory segment
``taas-<job>-<loader>-c<channel>-b<n>`` it created, and sends a 32-byte message naming the
block through the channel's ``data`` FIFO.  The consumer (a rank) maps the block (once; blocks
are reused) and builds the unit's tensors *over the block* -- no copy on the rank side.  When the
last of them is garbage, the block goes back to the producer's pool (a message on the ``space``
FIFO) and is reused without page faults.  So each unit's bytes are copied once, by the producer.

Bounded: the producer waits while the bytes *in flight* (sent, not yet taken by the rank) would
exceed the channel's bound, or 256 messages are in flight.  What a rank keeps after taking it is
its own memory (the pool grows rather than the channel deadlocking); free blocks beyond the
bound are retired.  All names start with ``taas-<job id>-``: the kernel unlinks them when the
job ends, the start process when the kernel died.

Header segment, in u64 words::

    0           global    magic, version, workers, channels, bound
    512         workers   64 bytes each: produced, state, unit, since (f64), prefetched
    ...         channels  128 bytes each: producer line (sent msgs, sent bytes, units, waiting)
                                          consumer line (taken msgs, taken bytes, pid, closed,
                                          wanted unit + 1, since (f64))

Block: a 64-byte header (size and where the parts are), tensors a collate function wrote in
place (a :class:`Draft`), the pickled structure, the buffer table, then the copied blobs,
64-byte aligned.  A side about to wait drains its FIFO, checks the counters
again, then sleeps in ``select``; a full FIFO means the other side has bytes to read, so no
wake-up is lost.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import _posixshmem

from taas.data.transport import DATA, PASS_END, Header, Receiver, Sender, align, decode, encode

MAGIC = 0x7461617364617461
VERSION = 2
GLOBAL_BYTES, WORKER_BYTES, CHANNEL_BYTES = 512, 64, 128
MAX_IN_FLIGHT = 256  # messages per channel (the data FIFO holds 2048)
# worker words
W_PRODUCED, W_STATE, W_UNIT, W_SINCE, W_PREFETCHED = range(5)
STARTING, LOADING, BLOCKED, DONE = range(4)
STATE_NAMES = {STARTING: "starting", LOADING: "loading", BLOCKED: "waiting for buffer space", DONE: "done"}
# channel words: producer line, consumer line (its own cache line)
C_SENT_MSGS, C_SENT_BYTES, C_UNITS, C_WAITING = 0, 1, 2, 3
C_TAKEN_MSGS, C_TAKEN_BYTES, C_PID, C_CLOSED, C_WANT, C_WANT_SINCE = 8, 9, 10, 11, 12, 13
RETIRE = 9  # message kind: the producer unlinked a block; unmap it
FREED, TAKEN = 1, 2  # space messages
_MSG = struct.Struct("<4Q")  # kind, unit, block, aux
_BACK = struct.Struct("<2Q")  # kind, block
_BLOCK = struct.Struct("<8Q")  # size, meta at, meta length, buffers, table at, blobs at
_ENTRY = struct.Struct("<2Q")
SHM_PREFIX = "taas-"


def segment_name(job_id: str, index: int) -> str:
    return f"{SHM_PREFIX}{job_id}-{index}"


def size_class(n: int) -> int:
    """Block sizes: steps of 1/8 of the next power of two (at most 12.5% unused), whole pages."""
    n = max(n, 4096)
    step = max(4096, (1 << (n - 1).bit_length()) // 8)
    return (n + step - 1) // step * step


@dataclass(frozen=True)
class Layout:
    workers: int
    channels: int
    bound: int  # bytes in flight per channel

    @property
    def channels_offset(self) -> int:
        return GLOBAL_BYTES + self.workers * WORKER_BYTES

    @property
    def size(self) -> int:
        return self.channels_offset + self.channels * CHANNEL_BYTES


def _shm_create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def _shm_attach(name: str) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def unlink_job(job_id: str) -> list[str]:
    """Unlink every segment of job ``job_id`` (the header and all blocks); returns the names."""
    prefix = f"{SHM_PREFIX}{job_id}-"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        unlink(name)
    return names


class Segment:
    """A loader's header segment, mapped.  ``q``/``d`` see its words as u64 / f64."""

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout):
        self.name, self.mm, self.layout = name, mm, layout
        self.q = memoryview(mm).cast("Q")
        self.d = memoryview(mm).cast("d")

    @classmethod
    def create(cls, name: str, layout: Layout) -> "Segment":
        seg = cls(name, _shm_create(name, layout.size), layout)
        for i, v in enumerate((MAGIC, VERSION, layout.workers, layout.channels, layout.bound)):
            seg.q[i] = v
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        mm = _shm_attach(name)
        magic, version, workers, channels, bound = struct.unpack_from("<5Q", mm, 0)
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise RuntimeError(f"shared-memory segment {name} is not a taas data segment")
        return cls(name, mm, Layout(workers, channels, bound))

    def _w(self, worker: int, word: int) -> int:
        return (GLOBAL_BYTES + worker * WORKER_BYTES) // 8 + word

    def _c(self, channel: int, word: int) -> int:
        return (self.layout.channels_offset + channel * CHANNEL_BYTES) // 8 + word

    def worker(self, worker: int, word: int) -> int:
        return self.q[self._w(worker, word)]

    def set_worker(self, worker: int, word: int, value: int) -> None:
        self.q[self._w(worker, word)] = value

    def worker_since(self, worker: int) -> float:
        return self.d[self._w(worker, W_SINCE)]

    def set_worker_state(self, worker: int, state: int, unit: int = 0) -> None:
        self.d[self._w(worker, W_SINCE)] = time.monotonic()
        self.q[self._w(worker, W_UNIT)] = unit
        self.q[self._w(worker, W_STATE)] = state

    def channel(self, channel: int, word: int) -> int:
        return self.q[self._c(channel, word)]

    def set_channel(self, channel: int, word: int, value: int) -> None:
        self.q[self._c(channel, word)] = value

    def want_since(self, channel: int) -> float:
        return self.d[self._c(channel, C_WANT_SINCE)]

    def set_want(self, channel: int, unit: int | None) -> None:
        if unit is None:
            self.q[self._c(channel, C_WANT)] = 0
        else:
            self.d[self._c(channel, C_WANT_SINCE)] = time.monotonic()
            self.q[self._c(channel, C_WANT)] = unit + 1

    def close(self) -> None:
        self.q.release()
        self.d.release()
        self.mm.close()


def make_fifos(directory: str, loader: int, channel: int) -> tuple[str, str]:
    paths = (os.path.join(directory, f"data-{loader}-{channel}.fifo"),
             os.path.join(directory, f"space-{loader}-{channel}.fifo"))
    for path in paths:
        os.mkfifo(path, 0o600)
    return paths


def _open_fifo(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)  # never blocks on open, never sees EOF


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Block:
    __slots__ = ("id", "size", "name", "mm", "u8", "address")

    def __init__(self, block_id: int, size: int, name: str, mm: mmap.mmap):
        import torch

        self.id, self.size, self.name, self.mm = block_id, size, name, mm
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8)
        self.address = self.u8.data_ptr()


class Draft:
    """A block lent to a collate function before the unit exists: ``alloc`` hands out tensors
    in it, so the collated batch is written where the rank will read it (no second copy)."""

    def __init__(self, block: _Block):
        self.block = block
        self.top = _BLOCK.size

    def alloc(self, nbytes: int, dtype, shape):
        start = align(self.top)
        if nbytes <= 0 or start + nbytes > self.block.size:
            return None
        self.top = start + nbytes
        return self.block.u8[start:start + nbytes].view(dtype).view(shape)


class ShmSender(Sender):
    """The producer end of one channel.  ``on_wait(True/False)`` brackets waiting for space."""

    def __init__(self, seg: Segment, channel: int, fifos: tuple[str, str], on_wait=None):
        self.seg, self.ch = seg, channel
        self.bound = seg.layout.bound
        self.data_fd, self.space_fd = _open_fifo(fifos[0]), _open_fifo(fifos[1])
        self.on_wait = on_wait
        self.sent_msgs = self.sent_bytes = self.units = 0
        self.blocks: dict[int, _Block] = {}
        self.free: list[_Block] = []
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
        whole = len(data) - len(data) % _BACK.size
        self._back = data[whole:]
        for kind, block_id in _BACK.iter_unpack(data[:whole]):
            if kind == FREED and block_id in self.blocks:
                self.free.append(self.blocks[block_id])

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
                select.select([self.space_fd], [], [], 0.1)
        finally:
            self.seg.set_channel(self.ch, C_WAITING, 0)
            if self.on_wait:
                self.on_wait(False)

    # -- blocks ----------------------------------------------------------------------------
    def _block(self, size: int) -> _Block:
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
        name = f"{self.seg.name}-c{self.ch}-b{block_id}"
        block = self.blocks[block_id] = _Block(block_id, want, name, _shm_create(name, want))
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
        top = draft.top if draft else _BLOCK.size
        meta_at = align(top)
        table_at = meta_at + (len(enc.meta) + 7) // 8 * 8
        blob_at = align(table_at + _ENTRY.size * len(enc.buffers))
        size = blob_at + enc.nbytes
        if not self._wait(size):
            if draft is not None:
                self.free.append(draft.block)
            return False
        if draft is not None and size <= draft.block.size:
            block = draft.block
        else:
            block = self._block(size)
            if draft is not None:  # outgrew its draft: move what was collated there
                block.mm[_BLOCK.size:top] = draft.block.mm[_BLOCK.size:top]
                self.free.append(draft.block)
        mm, u8 = block.mm, block.u8
        _BLOCK.pack_into(mm, 0, size, meta_at, len(enc.meta), len(enc.buffers), table_at, blob_at, 0, 0)
        mm[meta_at:meta_at + len(enc.meta)] = enc.meta
        for j, (offset, nbytes) in enumerate(enc.buffers):
            _ENTRY.pack_into(mm, table_at + _ENTRY.size * j, offset, nbytes)
        for offset, nbytes, src in enc.blobs:
            if not nbytes:
                continue
            lo = blob_at + offset
            if isinstance(src, memoryview):
                mm[lo:lo + nbytes] = src
            else:
                u8[lo:lo + nbytes].view(src.dtype).view(src.shape).copy_(src)
        self.units += 1
        self.last_size = size
        self.seg.set_channel(self.ch, C_UNITS, self.units)
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
        os.write(self.data_fd, _MSG.pack(kind, unit, block, aux))  # < MAX_IN_FLIGHT: never full

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
            if len(self._inbox) < _MSG.size:
                self._inbox += _read_all(self.data_fd)
            if len(self._inbox) >= _MSG.size:
                msg = _MSG.unpack_from(self._inbox)
                self._inbox = self._inbox[_MSG.size:]
                if msg[0] == RETIRE:
                    mm = self.blocks.pop(msg[2], None)
                    if mm is not None:
                        _close_quietly(mm)
                    self._taken(0)
                    continue
                return msg
            self._back(None)  # retry what the producer had no room for
            select.select([self.data_fd], [], [], 0.5)

    def take(self):
        kind, unit, block_id, _ = self._cur or self._next()
        self._cur = None
        assert kind == DATA, kind
        mm = self.blocks.get(block_id)
        if mm is None:
            mm = self.blocks[block_id] = _shm_attach(f"{self.seg.name}-c{self.ch}-b{block_id}")
        size, meta_at, meta_len, nbuf, table_at, blob = struct.unpack_from("<6Q", mm, 0)
        meta = bytes(mm[meta_at:meta_at + meta_len])
        table = [_ENTRY.unpack_from(mm, table_at + _ENTRY.size * j) for j in range(nbuf)]
        buffers = [bytearray(mm[blob + off:blob + off + n]) for off, n in table]
        lease = memoryview(mm)
        lent = []

        def tensor_at(offset: int, nbytes: int, dtype, shape, in_place: bool):
            import torch

            start = offset if in_place else blob + offset
            t = torch.frombuffer(lease, dtype=dtype, count=nbytes // _itemsize(dtype), offset=start)
            if self.pin:
                t = t.pin_memory()
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
        self._back(_BACK.pack(TAKEN, 0))

    def _free(self, block_id: int) -> None:  # may run in any thread (garbage collection)
        self._back(_BACK.pack(FREED, block_id))

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
                    if _BACK.unpack(self._pending[-1])[0] == TAKEN:
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
            os.write(self.space_fd, _BACK.pack(TAKEN, 0))
        except BlockingIOError:
            pass


def _itemsize(dtype) -> int:
    return dtype.itemsize


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # tensors still view it; it goes when they do
        pass
