"""Big arrays among the shipped values: written once to shared memory, mapped copy-on-write.

Pickled the ordinary way, a CPU tensor's storage becomes ``torch.save`` bytes inside the
payload, and every rank reads and decodes its own copy (a 1 GiB tensor costs tens of seconds
and a GiB per rank).  Instead, while :func:`taas.job.package.ship` pickles the cell's values,
each CPU tensor storage and each plain, contiguous numpy array of at least :data:`THRESHOLD`
bytes is written once, by ``pwrite`` from a few threads, to its own file ``<dir>/taas-<job>-value<i>``
(``/dev/shm`` in a job; mode 0400) and the pickle holds only (file, size, dtype, shape).  The
files are written unnamed (``O_TMPFILE``) and named by :meth:`BigValues.publish` when pickling
is done, so a kernel killed meanwhile leaves nothing.  A
rank maps the file ``MAP_PRIVATE``: pages are read from the one shared copy on first touch, and
a write gives the writing rank its own copy of the page it touched -- never another rank's
values, the file, or the notebook's object (the file is a copy of it).

Tensors are handled at the *storage*: torch's own tensor reductions (views, strides, storage
offsets, ``nn.Parameter``, sparse/quantized/nested layouts, ``requires_grad``) still apply,
only the bytes travel differently.  A storage is written once however many tensors view it,
and pickle's memo makes them views of one storage again in the rank.  Left on the ordinary
path: non-CPU storages, numpy subclasses (``np.memmap``, masked arrays), object and
non-contiguous arrays.  When the directory lacks room (statvfs, or a failed write) a value
travels the ordinary way and :attr:`BigValues.notes` says so in one line.

**Resident tensors.**  Copying a GiB into fresh shared memory costs most of a second (new pages),
every job.  So a CPU tensor storage that torch allocated is moved *in place*, once, onto an
unnamed shared-memory file (:mod:`taas.job.memory.resident`: its pages are remapped, the addresses
stay, so views and other aliases keep working; the move overlaps the job's start).  A later job sends
the same storage with no copy at all: the launcher passes the file's descriptor to every
process (:attr:`BigValues.fds`, ``LaunchSpec.shared_fds``), which maps it copy-on-write.  A
storage already shared by descriptor (``share_memory_()``) travels the same way.  Storages that
cannot move (memory torch does not own, such as ``torch.from_numpy``; one with a ``.numpy()``
alias, which torch marks not resizable; an allocation in the heap)
are written to a file per job, as arrays are.

**Device storages.**  A CUDA storage among the shipped values (:mod:`taas.job.devices` decides
where it lands) is copied once, straight from the device, into an unnamed shared-memory file
passed by descriptor (:meth:`BigValues.copy_in`): every rank maps that one copy and moves it to
its own GPU, instead of each rank decoding its own pickled copy.

The kernel removes the files after the job (:meth:`BigValues.unlink`); the launcher removes
them too, when the job's processes ended or the kernel died (:meth:`BigValues.cleanups`, a
``LaunchSpec.cleanups`` hook).

No torch or numpy import at module level: the kernel side only looks at types of modules the
notebook already imported.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading

from taas.job.memory import resident
from taas.job.memory import files as shmfiles
from taas.job.memory.resident import ResidentMemory
from taas.job.memory.channel import CHANNEL_ENV, ResultChannel
from taas.shield import deferred_interrupt

_UNNAMED_OK = shmfiles.UNNAMED_OK  # (the same dict: tests set a directory's entry here)

THRESHOLD = 1 << 20  # bytes: smaller arrays stay inline in the pickle
SHM_DIR = "/dev/shm"
ROOM_MARGIN = 64 << 20  # bytes left free in SHM_DIR after writing a value
# Files passed by descriptor in one job (resident, device copies): a launcher passes 64, and
# one of them is the results channel (open_results_channel).
MAX_FDS = 63

log = logging.getLogger(__name__)


class BigValues:
    """The kernel side for one job: writes big arrays to files, remembers them, removes them."""

    def __init__(self, job_id: str, directory: str = SHM_DIR, threshold: int = THRESHOLD,
                 resident: ResidentMemory | None = None, files: bool = True):
        self.job_id, self.directory, self.threshold = job_id, directory, threshold
        # The kernel's moved storages (see above); None: every storage is copied per job.
        self.resident = resident
        # /proc/self/maps, read once per job: a move changes only its own range's lines, and
        # a range being moved is found by ResidentMemory without them.
        self._maps = None
        # Named files in ``directory`` reach only processes on this machine: a job on a
        # cluster (files=False) sends resident storages by descriptor and pickles the rest.
        self.files = files
        self.fds: list[int] = []  # our duplicates of resident storages' files, for the launcher
        self.paths: list[str] = []  # named files
        self._unnamed: list[tuple[int, str]] = []  # (fd, name it gets) until publish()
        self.written = 0  # bytes
        self._left_out = 0  # bytes that did not fit and travelled the ordinary way
        self._free: int | None = None
        self._storages: dict[int, tuple] = {}  # StorageImpl address -> (storage, path or None)
        self._types = _candidate_types()
        self.channel: ResultChannel | None = None  # rank 0's results come back on it

    @property
    def notes(self) -> list[str]:
        if not self._left_out:
            return []
        return [f"taas: note: {self.directory} had too little free space for "
                f"{_mib(self._left_out)} of the cell's large arrays, so they were pickled to each "
                f"rank instead (slower, one copy per rank); free or enlarge {self.directory} to "
                "send them once"]

    # -- pickling (called by package's pickler for every object it is about to reduce) -------
    def reduce(self, obj):
        """A reduce tuple that maps ``obj`` from shared memory in the rank, or NotImplemented."""
        kind = self._types.get(type(obj))
        if kind is None:
            return NotImplemented
        if kind == "array":
            return self._reduce_array(obj)
        if kind == "typed":  # what a tensor's reduction pickles: dtype + untyped storage
            untyped = obj._untyped_storage
            if untyped.device.type != "cpu" or untyped.nbytes() < self.threshold:
                return NotImplemented
            untyped = self._storage(untyped)
            if untyped is None:
                return NotImplemented
            return _typed_storage, (untyped, obj.dtype)
        # an untyped storage: the user's own, or the canonical one of a typed storage above
        if obj.device.type != "cpu" or obj.nbytes() < self.threshold:
            return NotImplemented
        canonical = self._storage(obj)
        if canonical is None:
            return NotImplemented
        if canonical is not obj:  # another Python object for the same storage
            return _same, (canonical,)
        where = self._storages[obj._cdata][1]
        if isinstance(where, tuple):  # (index of a passed descriptor, offset, complete at)
            return _map_storage, (where[0], obj.nbytes(), *where[1:])
        return _map_storage, (where, obj.nbytes())

    def _storage(self, untyped):
        """The one object standing for this storage in the pickle (so pickle's memo makes every
        view of it share one storage in the rank), written to a file; None if it did not fit."""
        entry = self._storages.get(untyped._cdata)
        if entry is None:
            where = self._resident_fd(untyped) if self.resident is not None else None
            if where is None:
                nbytes = untyped.nbytes()
                data = (ctypes.c_char * nbytes).from_address(untyped.data_ptr())
                where = self._write(memoryview(data))
            entry = self._storages[untyped._cdata] = (untyped, where)
        return entry[0] if entry[1] is not None else None

    def _resident_fd(self, untyped) -> tuple[int, int, int | None] | None:
        """(index in :attr:`fds`, offset, length the file exceeds once complete) of
        ``untyped``'s bytes in a shared-memory file, moving its allocation there (in the
        background: :mod:`taas.job.memory.resident`); None where that cannot be done."""
        if len(self.fds) >= MAX_FDS:  # more big tensors than that: the rest go as files
            return None
        try:
            fd, offset, complete = untyped._get_shared_fd(), 0, None  # shared by share_memory_()
        except RuntimeError:  # not shared by torch: moved by us before, or to move now
            if not untyped.resizable():  # memory torch does not own (from_numpy, from_file, ...)
                return None
            if self._maps is None:
                self._maps = resident.read_maps()
            moved = self.resident.moved
            got = self.resident.share(untyped.data_ptr(), untyped.nbytes(), self._room, self._maps)
            if self.resident.moved != moved:
                self._free -= self.resident.moved - moved
                self.written += self.resident.moved - moved
                log.debug("tensor storage of %s moving to shared memory for good", _mib(untyped.nbytes()))
            if got is None:
                return None
            fd, offset, complete = got
        except AttributeError:  # a torch without it
            return None
        if fd is None or fd < 0:  # (-1: mapped from a named file; that goes the file way)
            return None
        self.fds.append(os.dup(fd))  # ours for the job: the storage may be freed meanwhile
        log.debug("tensor storage of %s travels by descriptor (resident shared memory, #%d)",
                  _mib(untyped.nbytes()), len(self.fds) - 1)
        return len(self.fds) - 1, offset, complete

    def copy_in(self, storage):
        """A reduce tuple that maps, in the rank, a copy of ``storage`` (on a device: a CUDA
        storage, see :mod:`taas.job.devices`) written here once, straight from the device, into
        an unnamed shared-memory file passed by descriptor (on this machine and to a cluster
        alike); None where it is too small, or there is no room or descriptor left."""
        nbytes = storage.nbytes()
        if nbytes < self.threshold or len(self.fds) >= MAX_FDS or not self._room(nbytes):
            return None
        import torch

        try:
            fd = shmfiles.open_unnamed(self.directory, os.O_RDWR)
        except OSError:  # a directory without O_TMPFILE
            fd = os.memfd_create("taas-value", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            host = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(host).copy_(flat)  # type: ignore[arg-type]  # one copy, into shared pages
            del host, flat
        except (OSError, RuntimeError):  # ENOSPC (a bus error is avoided by _room): pickled instead
            os.close(fd)
            return None
        self.fds.append(fd)
        self._free -= nbytes
        self.written += nbytes
        log.debug("device storage of %s copied once to shared memory (#%d)", _mib(nbytes), len(self.fds) - 1)
        return _map_storage, (len(self.fds) - 1, nbytes)

    def _room(self, nbytes: int) -> bool:
        if self._free is None:
            try:
                st = os.statvfs(self.directory)
                self._free = st.f_bavail * st.f_frsize
            except OSError:
                self._free = 0
        return nbytes + ROOM_MARGIN <= self._free

    def _reduce_array(self, array):
        if array.nbytes < self.threshold or array.dtype.hasobject:
            return NotImplemented
        if array.flags.c_contiguous:
            order = "C"
        elif array.flags.f_contiguous:
            order = "F"
        else:
            return NotImplemented
        import numpy as np

        path = self._write(memoryview(array.ravel(order="K").view(np.uint8)))
        if path is None:
            return NotImplemented
        return _map_array, (path, array.dtype, array.shape, order, bool(array.flags.writeable))

    def _write(self, data: memoryview) -> str | None:
        nbytes = data.nbytes
        if not self.files:
            return None
        if not self._room(nbytes):
            log.debug("no room in %s for %s: pickled to each rank instead", self.directory, _mib(nbytes))
            self._left_out += nbytes
            return None
        path = os.path.join(self.directory, f"taas-{self.job_id}-value{len(self.paths) + len(self._unnamed)}")
        fd, named = shmfiles.create(self.directory, path)
        try:
            shmfiles.write_parallel(fd, data)
            os.fchmod(fd, 0o400)  # nobody opens it for writing again
        except OSError:  # ENOSPC: a race with another writer; this value goes the ordinary way
            os.close(fd)
            if named:
                shmfiles.remove(path)
            self._left_out += nbytes
            self._free = 0
            return None
        if named:
            os.close(fd)
            self.paths.append(path)
        else:
            self._unnamed.append((fd, path))
        self._free -= nbytes
        self.written += nbytes
        log.debug("large value of %s written once to %s", _mib(nbytes), path)
        return path

    def publish(self) -> None:
        """Give the files their names (the payload refers to them), once pickling is done: a
        kernel killed while writing them leaves nothing behind, as unnamed files vanish."""
        while self._unnamed:
            fd, path = self._unnamed.pop(0)
            try:
                shmfiles.link(fd, path)
                self.paths.append(path)
            finally:
                os.close(fd)

    def unlink(self, wait: bool = True) -> None:
        """Remove the files (after the job, or when shipping failed).  Ranks that still map
        one keep their mapping; the memory is freed when the last one unmaps.

        Freeing a GiB takes ~0.2 s: ``wait=False`` leaves that to a thread (the launcher also
        removes them when the job's last process ended, :meth:`cleanups`, so nothing depends
        on it)."""
        for fd, _ in self._unnamed:
            os.close(fd)
        self._unnamed.clear()
        self.close_fds()
        paths, self.paths = self.paths, []
        self._storages.clear()
        if wait or not paths:
            for path in paths:
                shmfiles.remove(path)
        else:
            threading.Thread(target=lambda: [shmfiles.remove(p) for p in paths], name="taas-unlink",
                             daemon=True).start()

    def cleanups(self) -> tuple:
        """The files' removal as ``LaunchSpec.cleanups`` hooks, for the launcher to run when the
        job is over or the kernel died (call after :meth:`publish`: the files have names)."""
        return ((f"{__name__}:remove_files", (tuple(self.paths),)),) if self.paths else ()

    def open_results_channel(self) -> dict[str, str]:
        """The job's results channel (:mod:`taas.job.memory.channel`), after pickling: its rank
        end goes last in :attr:`fds`; returns the environment that tells rank 0 where it is."""
        with deferred_interrupt():  # made and held as one step: a Ctrl-C cannot orphan it
            self.channel = ResultChannel()
            self.fds.append(os.dup(self.channel.rank_end()))
        return {CHANNEL_ENV: str(len(self.fds) - 1)}

    def close_fds(self) -> None:
        """Close our duplicates of the resident files (once the launcher has passed them on)
        and the results channel (what rank 0 sent and nobody took goes with it), as one step."""
        with deferred_interrupt():
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)
            channel, self.channel = self.channel, None
            if channel is not None:
                channel.close()


def _candidate_types() -> dict[type, str]:
    """The types worth a look, from the modules the notebook has imported (none imported,
    nothing to look at)."""
    types: dict[type, str] = {}
    np = sys.modules.get("numpy")
    if np is not None:
        types[np.ndarray] = "array"
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "UntypedStorage"):
        types[torch.storage.TypedStorage] = "typed"
        types[torch.UntypedStorage] = "untyped"
    return types


# -- in the rank: called by the unpickler ------------------------------------------------------
SHARED_FDS_ENV = "TAAS_SHARED_FDS"  # the job's shared fds as this process has them: "5,6,..."


def _map_storage(where, nbytes: int, offset: int = 0, complete: int | None = None):
    """A storage over a private (copy-on-write) mapping of ``nbytes`` at ``offset`` of file
    ``where`` (a path, or the index of a file descriptor the launcher passed); pages load on
    first touch.  ``complete``: the kernel may still be moving the tensor into the file; it is
    complete once longer than that (:func:`taas.job.memory.resident.wait_moved`)."""
    import torch

    if isinstance(where, int):
        fd = int(os.environ.get(SHARED_FDS_ENV, "").split(",")[where])
        if complete is not None:
            resident.wait_moved(fd, complete)
        if offset:
            import mmap

            start = offset - offset % mmap.PAGESIZE
            mapped = mmap.mmap(fd, offset - start + nbytes, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            # The storage keeps the view, and so the mapping, alive; unmapped when it dies.
            view = memoryview(mapped)[offset - start:]
            return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
        where = f"/proc/self/fd/{fd}"
    return torch.UntypedStorage.from_file(where, shared=False, nbytes=nbytes)


def _typed_storage(untyped, dtype):
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _map_array(path: str, dtype, shape: tuple, order: str, writeable: bool):
    import mmap

    import numpy as np

    nbytes = math.prod(shape) * dtype.itemsize
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    array = np.frombuffer(mapped, dtype=dtype).reshape(shape, order=order)
    if not writeable:
        array.flags.writeable = False
    return array


def _same(value):
    return value


def remove_files(paths: tuple[str, ...]) -> None:
    """The :meth:`BigValues.cleanups` hook: remove a job's files (from any process)."""
    for path in paths:
        shmfiles.remove(path)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"
