"""Big storages of rank 0's results: read by the kernel straight out of rank 0's memory, or
handed over as memory files where it may not read it.

Pickled inline, a 1 GiB result tensor was copied five times on its way back (into the value's
pickle, into ``Results``' pickle, into ``result.pkl``, out of it, and into a new storage):
7.5-9.4 s and several GiB of the notebook's memory.  Now it is copied once::

    rank 0   storage >= THRESHOLD: held (a device one: copied to host memory first); the value's
             pickle holds (_map_result, (index, nbytes)); result.pkl names the token
             ──Regions(token, [(address, nbytes)])──> the job's results channel, and waits
    kernel   process_vm_readv, two threads ──> new storages of its own ──Answer──>
             rank 0 goes on (exits, or runs its next kept cell)
    kernel   unpickling: _map_result(index) is the storage read for ``index``

Where the kernel may not read rank 0 (:class:`taas.job.memory.readback.Unreadable`), rank 0
writes each storage once into a sealed memfd and sends the fds instead; the kernel maps each as
the storage itself (torch's shared-fd storage, like one from ``torch.multiprocessing``).  The
channel and its messages are :mod:`taas.job.memory.channel`.  Nothing ever has a name: a failed
job (the kernel closes the channel: what was read or queued is dropped), a rank killed meanwhile,
or a killed kernel leave nothing behind, in ``/dev/shm`` or anywhere.

In the notebook a big result is an ordinary tensor: its storage is the kernel's own memory,
resizable, growing the notebook by the value's size and no more.  A later job that reads it
moves it to shared memory in place, as any notebook tensor (:mod:`taas.job.memory.resident`).
Storages shared by several result names come back as one storage, as they were on rank 0.

On a cluster there is no channel (the kernel is not on rank 0's machine): big values come back
inside the pickle, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat

from taas.job.memory import channel as wire
from taas.job.memory import files as shmfiles
from taas.job.memory import readback

THRESHOLD = 1 << 20  # bytes: smaller storages stay inline in the pickle
MAX_STORAGES = 4096  # storages per job at most (the rest inline): files in flight count against limits
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

log = logging.getLogger(__name__)


# -- rank 0 ------------------------------------------------------------------------------------
class Returns:
    """Rank 0's side for one set of results: big storages held as they are pickled
    (:meth:`reduce` for CPU storages, :meth:`copy_in` for device ones), then :meth:`send`
    has the kernel read them (or sends them as files)."""

    def __init__(self, channel: int, threshold: int = THRESHOLD):
        self.channel, self.threshold = channel, threshold
        self.token = os.urandom(16)
        self.held: list = []  # index -> the CPU storage whose bytes go back
        self.written = 0  # bytes held
        self._storages: dict[int, tuple] = {}  # StorageImpl address -> (canonical object, index)

    def reduce(self, obj):
        """A CPU storage (typed or untyped) of at least ``threshold`` bytes: a reduce tuple
        that finds it in the kernel; else NotImplemented (it goes inline)."""
        import torch

        typed = isinstance(obj, torch.storage.TypedStorage)
        untyped = obj._untyped_storage if typed else obj
        if untyped.device.type != "cpu" or untyped.nbytes() < self.threshold or untyped.data_ptr() == 0:
            return NotImplemented
        entry = self._entry(untyped, lambda: untyped)
        if entry is None:
            return NotImplemented
        canonical, index = entry
        if typed:
            return _typed_storage, (canonical, obj.dtype)
        if canonical is not obj:  # another Python object for the same storage: pickle's memo
            return _same, (canonical,)
        return _map_result, (index, untyped.nbytes())

    def copy_in(self, storage):
        """A device storage (its bytes copied once, into host memory that goes back as a CPU
        storage): a reduce tuple for the kernel's host copy, or None (inline)."""
        if storage.nbytes() < self.threshold:
            return None
        entry = self._entry(storage, lambda: _host_copy(storage))
        return None if entry is None else (_map_result, (entry[1], storage.nbytes()))

    def _entry(self, untyped, host):
        entry = self._storages.get(untyped._cdata)
        if entry is None:
            if len(self.held) >= MAX_STORAGES:
                return None
            try:
                bytes_back = host()
            except RuntimeError as exc:  # no host memory for a device storage: inline
                log.debug("result storage of %d bytes inline: %s", untyped.nbytes(), exc)
                return None
            self.held.append(bytes_back)
            self.written += untyped.nbytes()
            entry = self._storages[untyped._cdata] = (untyped, len(self.held) - 1)
        return entry

    def send(self) -> None:
        """Have the kernel read every storage held, waiting until it has; where it may not,
        send them as memory files.  OSError when the channel refuses (the caller then sends
        the values inline)."""
        try:
            regions = [(st.data_ptr(), st.nbytes()) for st in self.held]
            if wire.ask_to_read(self.channel, self.token, regions):
                return
            fds: list[int] = []
            try:
                for st in self.held:
                    fds.append(_file_of(st))
                wire.send_files(self.channel, self.token, fds)
            finally:
                wire.close_fds(fds)
        finally:
            self.close()

    def close(self) -> None:
        self.held = []
        self._storages.clear()


def _host_copy(storage):
    import torch

    host = readback.empty(storage.nbytes())
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    torch.empty(0, dtype=torch.uint8).set_(host).copy_(flat)  # type: ignore[arg-type]
    return host


def _file_of(untyped) -> int:
    """A sealed memfd holding the CPU storage's bytes (written in parallel)."""
    import ctypes

    fd = _memfd(untyped.nbytes())
    try:
        data = (ctypes.c_char * untyped.nbytes()).from_address(untyped.data_ptr())
        shmfiles.write_parallel(fd, memoryview(data).cast("B"))
        _seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("taas-result", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def _seal(fd: int) -> None:
    """The size is final: a mapping of it can never fault past its end (SIGBUS)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


def _kept_fds_budget() -> int:
    """How many storages may keep their file's fd (half the soft limit, less what is open):
    beyond that they map the file and let the fd go (no resident path for them later)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft // 2 - wire.open_fds())


# -- the kernel, unpickling --------------------------------------------------------------------
_received: dict | None = None  # set by mapping() while results are unpickled


@contextlib.contextmanager
def mapping(taken: list | None):
    """Unpickle results under what :meth:`ResultChannel.take` gave for their token: the
    storages the kernel read, or rank 0's files (each becomes one storage, shared by every
    value that refers to it); None: they did not arrive."""
    global _received
    files = bool(taken) and isinstance(taken[0], int)
    before, _received = _received, {"taken": taken, "made": {}, "keep": _kept_fds_budget() if files else 0}
    try:
        yield
    finally:
        _received = before


def _map_result(index: int, nbytes: int):
    """The unpickler's call: rank 0's storage ``index`` as read, or over its file (no copy)."""
    received = _received
    if received is None or received["taken"] is None or not 0 <= index < len(received["taken"]):
        raise RuntimeError("its shared memory from rank 0 did not arrive")
    source = received["taken"][index]
    if not isinstance(source, int):
        if source.nbytes() != nbytes:
            raise RuntimeError("its memory from rank 0 is not what it should be")
        return source
    made = received["made"]
    if index not in made:
        keep = received["keep"] > 0
        made[index] = _storage_on(source, nbytes, keep)
        received["keep"] -= keep
    return made[index]


def _storage_on(fd: int, nbytes: int, keep_fd: bool = True):
    """A storage over the whole file ``fd`` (MAP_SHARED).  ``keep_fd``: torch's shared-fd
    storage, which keeps its own duplicate of the fd (closed when it is freed) so a later job
    can pass it on; else a plain mapping of the file."""
    import torch

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes:
        raise RuntimeError("its shared memory from rank 0 is not what it should be")
    if keep_fd:
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    return torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)


def _typed_storage(untyped, dtype):
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _same(value):
    return value
