"""Resident memory: a big tensor's own pages, moved in place onto a shared-memory file.

A rank is a separate process: to read a notebook tensor without a copy per rank, its bytes must
be in a file the ranks can map.  Copying a GiB into *fresh* shared memory costs 0.4-3 s on a VM
whose host takes back freed memory, and keeping a second copy doubles the notebook's memory.
So the allocation itself moves, once, chunk by chunk, in the background while the job starts:

    for each 32 MiB chunk:  pwrite(file, chunk)  then  mmap(chunk's address, MAP_SHARED|MAP_FIXED, file)

Every address of the allocation reads the same bytes before and after its chunk is remapped,
so nothing in the process can tell: tensors, numpy arrays made by ``tensor.numpy()``, DLPack
exports and raw pointers into it all keep working (a move that *swaps* the storage's pointer,
as ``share_memory_()`` does, frees the old pages under such aliases).  The anonymous pages of
a remapped chunk are freed at once and the next chunk's file pages reuse them, so the move
never needs more than one chunk of new memory: that is what makes it fast.  A job passes the
file's descriptor to every process, which maps it copy-on-write (see
:func:`taas.job.memory.bigvalues._map_storage`); later jobs pass it again with no copy at all.

The move overlaps the job's start (processes, rendezvous): :meth:`ResidentMemory.share`
returns the file at once, and a process that needs the bytes first waits until the file has
grown past the allocation's end -- the move writes that one byte last (:func:`wait_moved`).
The kernel waits for every move before the cell ends (:meth:`ResidentMemory.settle`), so the
notebook's own code never runs beside one.

Only allocations whose pages are theirs alone qualify: glibc's ``mmap``-ed chunks (every
allocation above its mmap threshold, at most 32 MiB), found from the chunk header glibc keeps
just below the pointer and checked against ``/proc/self/maps``.  glibc unmaps such a chunk
when it is freed (the mapping goes with it, nothing is reused) and never grows it in place for
torch, which resizes a storage by a new allocation.  Anything else -- a chunk in the heap, a
preloaded allocator, memory torch does not own -- is left alone; the caller copies it instead.

Visible differences, as after ``share_memory_()``: the pages count as shared memory (``Shmem``,
and against the size of ``/dev/shm``), and a child the kernel *forks* shares them instead of
getting a copy-on-write view.  A write made by another thread of the kernel while its chunk is
being moved may be lost (as with any copy made while a job starts).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import threading
import time
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
CHUNK = 32 << 20  # bytes moved at a time: the most new memory the move needs at once
MOVERS = 2  # threads moving one allocation (getting pages parallelises a little)
_HEADER = 2 * ctypes.sizeof(ctypes.c_size_t)  # glibc's chunk header: prev_size, size
_IS_MMAPPED = 0x2
_FLAGS = 0x7
_MAP_FIXED = 0x10

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps."""
    start: int
    end: int
    perms: str
    offset: int
    dev: tuple[int, int]
    inode: int


@dataclass(frozen=True)
class Block:
    """A moved allocation: its address range and the file it now lives in."""
    start: int
    length: int
    fd: int
    dev: tuple[int, int]
    inode: int


class ResidentMemory:
    """The kernel's moved allocations, for as long as the kernel lives (one per session).

    ``share(ptr, nbytes)`` gives (fd, offset) for the bytes ``[ptr, ptr + nbytes)``, moving
    their allocation first if needed; :meth:`prune` forgets allocations that were freed (their
    files go once the last process unmaps them)."""

    def __init__(self, directory: str = "/dev/shm"):
        self.directory = directory
        self._blocks: dict[int, Block] = {}
        self._moving: dict[int, threading.Thread] = {}  # start -> the thread moving that block
        self._lock = threading.Lock()
        self.moved = 0  # bytes moved so far (for tests and logs)

    def share(self, ptr: int, nbytes: int, room=lambda nbytes: True,
              maps: list[Mapping] | None = None) -> tuple[int, int, int] | None:
        """(our descriptor of the file, offset of ``ptr`` in it, the allocation's length: the
        file is complete once it is longer), or None where the memory does not qualify (see the
        module doc); ``room(nbytes)`` is asked before a file is written.  A new move runs in
        the background: :meth:`settle` before the notebook's code runs again."""
        if not supported():
            return None
        maps = read_maps() if maps is None else maps
        block = allocation(ptr, nbytes, maps)
        if block is None:
            return None
        start, length = block
        with self._lock:
            known = self._blocks.get(start)
            if known is not None and known.length == length and (start in self._moving
                                                                  or _backed_by(maps, known)):
                return known.fd, ptr - start, length
            if known is not None:  # freed since, and something new lives there
                self._forget(start)
            if not _anonymous(maps, start, length) or not room(length):
                return None
            try:
                fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError:
                return None
            st = os.fstat(fd)
            self._blocks[start] = Block(start, length, fd, (os.major(st.st_dev), os.minor(st.st_dev)),
                                        st.st_ino)
            thread = threading.Thread(target=self._move, args=(fd, start, length), daemon=True,
                                      name="taas-move")
            self._moving[start] = thread
            self.moved += length
            thread.start()
            return fd, ptr - start, length

    def _move(self, fd: int, start: int, length: int) -> None:
        try:
            move(fd, start, length)
            os.pwrite(fd, DONE, length)  # last: the file is complete (see wait_moved)
            return
        except BaseException as exc:
            log.warning("moving %d bytes to shared memory failed: %s", length, exc)
        # Every address still reads the right bytes (a chunk is remapped only once it was
        # written), but the file is not complete: processes waiting for it fail, in one line.
        try:
            os.pwrite(fd, FAILED, length)
        except OSError:  # pragma: no cover - a file we could not write at all
            pass

    def settle(self) -> None:
        """Wait for every move begun; forget the blocks whose move failed."""
        with self._lock:
            moving, self._moving = self._moving, {}
        for start, thread in moving.items():
            thread.join()
            with self._lock:
                block = self._blocks.get(start)
                if block is not None and os.pread(block.fd, 1, block.length) != DONE:
                    self._forget(start)

    def prune(self, maps: list[Mapping] | None = None) -> None:
        """Close the files of allocations that were freed (their range maps something else)."""
        self.settle()
        with self._lock:
            if not self._blocks:
                return
            maps = read_maps() if maps is None else maps
            for start, block in list(self._blocks.items()):
                if not _backed_by(maps, block):
                    self._forget(start)

    def close(self) -> None:
        """Close every file: the memory stays, mapped where it was, until it is freed."""
        self.settle()
        with self._lock:
            for start in list(self._blocks):
                self._forget(start)

    def __len__(self) -> int:
        return len(self._blocks)

    def _forget(self, start: int) -> None:
        os.close(self._blocks.pop(start).fd)


DONE, FAILED = b"\x01", b"\x00"  # the byte a move writes just past the allocation's end


def wait_moved(fd: int, length: int) -> None:
    """Return once file ``fd`` holds a complete move of ``length`` bytes (in a job's process,
    before it maps the file); OSError if the move failed."""
    pause = 0.0005
    while True:
        if os.fstat(fd).st_size > length:
            if os.pread(fd, 1, length) == DONE:
                return
            raise OSError("the kernel could not move a big tensor into shared memory (see the "
                          "kernel's log); run the cell again")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def supported() -> bool:
    """glibc's malloc is the allocator (no preloaded one) on Linux."""
    return (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
            and not os.environ.get("LD_PRELOAD"))


def read_maps(pid: str = "self") -> list[Mapping]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = fields[0].split("-")
            major, minor = fields[3].split(":")
            out.append(Mapping(int(lo, 16), int(hi, 16), fields[1], int(fields[2], 16),
                               (int(major, 16), int(minor, 16)), int(fields[4])))
    return out


def allocation(ptr: int, nbytes: int, maps: list[Mapping]) -> tuple[int, int] | None:
    """(start, length) of the glibc mmap-ed chunk holding ``[ptr, ptr + nbytes)``, or None.

    glibc puts a chunk header (prev_size, size) right below the pointer it returns; for a chunk
    of its own mapping, size has IS_MMAPPED set and the mapping is ``prev_size`` bytes below the
    header (the gap a memalign leaves), ``prev_size + size`` long (what ``free`` unmaps)."""
    if ptr % PAGE < _HEADER or nbytes <= 0:  # the header would be on another page: not one
        return None
    if not _covered(maps, ptr - ptr % PAGE, ptr + nbytes, lambda m: "r" in m.perms):
        return None  # not readable memory (the header is in ptr's own page)
    prev, size = (ctypes.c_size_t * 2).from_address(ptr - _HEADER)
    if not size & _IS_MMAPPED:
        return None
    start = ptr - _HEADER - prev
    length = prev + (size & ~_FLAGS)
    if start % PAGE or length % PAGE or start > ptr or start + length < ptr + nbytes:
        return None
    if length - nbytes > (1 << 20):  # a chunk is the allocation plus its header and alignment
        return None
    return start, length  # what maps the range is the caller's check (_anonymous, _backed_by)


def move(fd: int, start: int, length: int, chunk: int = CHUNK, movers: int = MOVERS) -> None:
    """Move ``[start, start + length)`` onto file ``fd`` in place, chunk by chunk (see the
    module doc), from up to ``movers`` threads."""
    parts = max(1, min(movers, os.cpu_count() or 1, length // chunk))
    bounds = [start + (length // PAGE * i // parts) * PAGE for i in range(parts)] + [start + length]

    def run(lo: int, hi: int) -> None:
        while lo < hi:
            n = min(chunk, hi - lo)
            data = (ctypes.c_char * n).from_address(lo)
            done = 0
            while done < n:
                done += os.pwrite(fd, memoryview(data)[done:], lo - start + done)
            _map_fixed(lo, n, fd, lo - start)
            lo += n

    in_parts(run, bounds, "taas-move")


def in_parts(work, bounds: list[int], name: str) -> None:
    """``work(bounds[i], bounds[i + 1])`` for every part at once: the first in this thread,
    the others in threads of their own; then the first error any of them raised."""
    errors: list[BaseException] = []

    def run(lo: int, hi: int) -> None:
        try:
            work(lo, hi)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(bounds[i], bounds[i + 1]), daemon=True, name=name)
               for i in range(1, len(bounds) - 1)]
    for thread in threads:
        thread.start()
    run(bounds[0], bounds[1])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


_libc = None


def _map_fixed(addr: int, length: int, fd: int, offset: int) -> None:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        _libc = libc
    got = _libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                     fd, offset)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap onto the shared file failed: {os.strerror(err)}")


def _covered(maps: list[Mapping], lo: int, hi: int, ok) -> bool:
    """Every address of ``[lo, hi)`` is in a mapping for which ``ok`` holds."""
    for m in maps:  # /proc/PID/maps is sorted by address
        if m.end <= lo:
            continue
        if m.start > lo or not ok(m):
            return False
        lo = m.end
        if lo >= hi:
            return True
    return lo >= hi


def _anonymous(maps: list[Mapping], start: int, length: int) -> bool:
    """The range is private, writable, anonymous memory (what glibc's mmap gives)."""
    return _covered(maps, start, start + length, lambda m: m.perms == "rw-p" and m.inode == 0)


def _backed_by(maps: list[Mapping], block: Block) -> bool:
    """The block's range still maps its file, at the offsets the move gave it."""
    return _covered(maps, block.start, block.start + block.length,
                    lambda m: m.perms == "rw-s" and m.inode == block.inode and m.dev == block.dev
                    and m.offset == m.start - block.start)
