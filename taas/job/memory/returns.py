"""Big storages of rank 0's results: written once to memory files, handed to the kernel by
descriptor, mapped there as the storages themselves.

Pickled inline, a 1 GiB result tensor was copied five times on its way back (into the value's
pickle, into ``Results``' pickle, into ``result.pkl``, out of it, and into a new storage):
7.5-9.4 s and several GiB of the notebook's memory.  Now it goes the way big values go out::

    rank 0   storage >= THRESHOLD ──pwrite, once──> memfd (unnamed; sealed: it cannot shrink)
             the value's pickle holds (_map_result, (index, nbytes)); result.pkl names the token
             every memfd ──sendmsg(SCM_RIGHTS), in batches──> the job's results channel
    kernel   channel ──recvmsg──> fds of rank 0's token ──_map_result──> a storage ON that file
             (torch's own shared-fd storage: MAP_SHARED, no copy; the fd is kept by the storage)

The channel is a ``SOCK_SEQPACKET`` socketpair the kernel makes per job (:class:`ResultChannel`);
its rank end travels to the job's processes as the last of ``LaunchSpec.shared_fds`` (index in
:data:`CHANNEL_ENV`).  Nothing ever has a name: a memfd lives while a process holds it or it
is in flight on the channel, so a failed job (the kernel closes the channel: queued fds are
dropped), a rank killed while writing, or a killed kernel leave nothing behind, in ``/dev/shm``
or anywhere.  Only what travels on the channel is fds and a fixed-size :class:`Batch` header --
never a pickle; the kernel takes only the fds of the token ``result.pkl`` names and closes any
others.

In the notebook a big result is a tensor over a storage like one received through
``torch.multiprocessing``: shared memory, not resizable (``resize_`` beyond its size raises, as
for ``torch.from_numpy``), everything else as usual.  That kind was chosen over a copy into a
resizable torch allocation because it costs no copy and no second GiB, and because such a
storage keeps its file's descriptor: the next job that reads the tensor passes that descriptor to
its ranks (:mod:`taas.job.memory.bigvalues`' resident path) instead of copying it again.  One
file per storage, so freeing one tensor frees its memory.  Storages shared by several result
names come back as one storage, as they were on rank 0.

On a cluster there is no channel (the kernel is not on rank 0's machine): big values come back
inside the pickle, as before.  Writing costs one copy into new shared pages on rank 0 (parallel
``pwrite``); mapping costs nothing until the notebook touches the pages, which were already made.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass

from taas.job.memory import files as shmfiles

THRESHOLD = 1 << 20  # bytes: smaller storages stay inline in the pickle
CHANNEL_ENV = "TAAS_RESULT_CHANNEL"  # index, in TAAS_SHARED_FDS, of the results channel
SHARED_FDS_ENV = "TAAS_SHARED_FDS"
MAX_FDS_PER_BATCH = 200  # SCM_RIGHTS carries at most 253 fds in one message
MAX_STORAGES = 4096  # files per job at most (the rest inline): in-flight fds count against limits
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """The header of one message on the channel; its fds follow as SCM_RIGHTS."""

    token: bytes  # 16 random bytes: which rank-0 results these files belong to
    first: int  # index of the message's first fd among the results' files

    _FORMAT = "<16sI"

    def pack(self) -> bytes:
        return struct.pack(self._FORMAT, self.token, self.first)

    @classmethod
    def unpack(cls, data: bytes) -> Batch | None:
        if len(data) != struct.calcsize(cls._FORMAT):
            return None
        token, first = struct.unpack(cls._FORMAT, data)
        return cls(token, first)


# -- the kernel's end --------------------------------------------------------------------------
class ResultChannel:
    """One job's channel, kernel side: :meth:`rank_end` goes to the processes, :meth:`take`
    collects rank 0's files after the job, :meth:`close` drops whatever is left."""

    def __init__(self):
        self._kernel, self._rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._kernel.setblocking(False)
        self._kernel.shutdown(socket.SHUT_WR)  # only rank 0 speaks

    def rank_end(self) -> int:
        """The fd to pass to the job's processes (owned by the channel; valid until close)."""
        return self._rank.fileno()

    def take(self, token: bytes, count: int) -> list[int] | None:
        """The ``count`` files rank 0 sent under ``token``, in order (the caller closes them),
        or None when they did not all arrive.  Every other file queued is closed."""
        _room_for_fds(count)
        got: dict[int, int] = {}
        for batch, fds in self._messages():
            if batch is None or batch.token != token:
                _close(fds)
                continue
            for i, fd in enumerate(fds, batch.first):
                if i in got or i >= count:
                    os.close(fd)
                else:
                    got[i] = fd
        if len(got) != count:
            log.warning("rank 0's results: %d of %d shared files arrived", len(got), count)
            _close(got.values())
            return None
        return [got[i] for i in range(count)]

    def _messages(self):
        size = socket.CMSG_SPACE(MAX_FDS_PER_BATCH * 4)
        while True:
            try:
                data, ancdata, flags, _ = self._kernel.recvmsg(64, size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("results channel: %s", exc)
                return
            if not data and not ancdata:
                return
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]))
            yield Batch.unpack(data) if not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) else None, fds

    def close(self) -> None:
        """Both ends; files still queued go with the socket."""
        self._kernel.close()
        self._rank.close()


# -- rank 0 ------------------------------------------------------------------------------------
def channel_from(environ) -> int | None:
    """The results channel's fd in this process (rank 0), or None: no channel (a cluster, or a
    launcher that passes no files) means big values travel inline."""
    try:
        index = int(environ[CHANNEL_ENV])
        return int(environ.get(SHARED_FDS_ENV, "").split(",")[index])
    except (KeyError, ValueError, IndexError):
        return None


class Returns:
    """Rank 0's side for one set of results: big storages written to memfds as they are
    pickled (:meth:`reduce` for CPU storages, :meth:`copy_in` for device ones), then
    :meth:`send` hands them to the kernel."""

    def __init__(self, channel: int, threshold: int = THRESHOLD):
        self.channel, self.threshold = channel, threshold
        self.token = os.urandom(16)
        self.fds: list[int] = []
        self.written = 0
        self._storages: dict[int, tuple] = {}  # StorageImpl address -> (canonical object, index)

    def reduce(self, obj):
        """A CPU storage (typed or untyped) of at least ``threshold`` bytes: a reduce tuple
        that maps it in the kernel; else NotImplemented (it goes inline)."""
        import torch

        typed = isinstance(obj, torch.storage.TypedStorage)
        untyped = obj._untyped_storage if typed else obj
        if untyped.device.type != "cpu" or untyped.nbytes() < self.threshold:
            return NotImplemented
        entry = self._entry(untyped, self._write_cpu)
        if entry is None:
            return NotImplemented
        canonical, index = entry
        if typed:
            return _typed_storage, (canonical, obj.dtype)
        if canonical is not obj:  # another Python object for the same storage: pickle's memo
            return _same, (canonical,)
        return _map_result, (index, untyped.nbytes())

    def copy_in(self, storage):
        """A device storage (its bytes copied once, straight into the memfd): a reduce tuple
        for the kernel's host copy, or None (inline)."""
        if storage.nbytes() < self.threshold:
            return None
        entry = self._entry(storage, self._write_device)
        return None if entry is None else (_map_result, (entry[1], storage.nbytes()))

    def _entry(self, untyped, write):
        entry = self._storages.get(untyped._cdata)
        if entry is None:
            if len(self.fds) >= MAX_STORAGES:
                return None
            fd = None
            try:
                fd = _memfd(untyped.nbytes())
                write(fd, untyped)
                _seal(fd)
            except (OSError, RuntimeError) as exc:  # no memory or fds left: this one goes inline
                if fd is not None:
                    os.close(fd)
                log.debug("result storage of %d bytes inline: %s", untyped.nbytes(), exc)
                return None
            self.fds.append(fd)
            self.written += untyped.nbytes()
            entry = self._storages[untyped._cdata] = (untyped, len(self.fds) - 1)
        return entry

    @staticmethod
    def _write_cpu(fd: int, untyped) -> None:
        import ctypes

        if untyped.data_ptr() == 0:
            raise RuntimeError("a storage without memory")
        data = (ctypes.c_char * untyped.nbytes()).from_address(untyped.data_ptr())
        shmfiles.write_parallel(fd, memoryview(data).cast("B"))

    @staticmethod
    def _write_device(fd: int, storage) -> None:
        import torch

        nbytes = storage.nbytes()
        host = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        torch.empty(0, dtype=torch.uint8).set_(host).copy_(flat)  # type: ignore[arg-type]

    def send(self) -> None:
        """Every file to the kernel, in batches; raises OSError when the channel refuses (the
        caller then sends the values inline).  Our fds are closed either way."""
        try:
            for first in range(0, len(self.fds), MAX_FDS_PER_BATCH):
                fds = self.fds[first:first + MAX_FDS_PER_BATCH]
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                sent = socket.socket(fileno=os.dup(self.channel))
                try:
                    sent.sendmsg([Batch(self.token, first).pack()], rights,
                                 socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                finally:
                    sent.close()
        finally:
            self.close()

    def close(self) -> None:
        fds, self.fds = self.fds, []
        _close(fds)
        self._storages.clear()


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


def _room_for_fds(count: int) -> None:
    """Raise our soft open-file limit towards the hard one so that ``count`` more fit (a
    kernel's soft limit is often 1024); where it cannot, the files that do not fit are lost
    (MSG_CTRUNC) and their values come back with a note."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _open_fds() + count + 64
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        except (ValueError, OSError):
            pass


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _kept_fds_budget() -> int:
    """How many storages may keep their file's fd (half the soft limit, less what is open):
    beyond that they map the file and let the fd go (no resident path for them later)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft // 2 - _open_fds())


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- the kernel, unpickling --------------------------------------------------------------------
_received: dict | None = None  # set by mapping() while results are unpickled


@contextlib.contextmanager
def mapping(fds: list[int] | None):
    """Unpickle results under rank 0's files ``fds`` (None: they did not arrive); each file
    becomes one storage, shared by every value that refers to it."""
    global _received
    before, _received = _received, {"fds": fds, "made": {}, "keep": _kept_fds_budget() if fds else 0}
    try:
        yield
    finally:
        _received = before


def _map_result(index: int, nbytes: int):
    """The unpickler's call: the storage over rank 0's file ``index`` (no copy)."""
    received = _received
    if received is None or received["fds"] is None or not 0 <= index < len(received["fds"]):
        raise RuntimeError("its shared memory from rank 0 did not arrive")
    made = received["made"]
    if index not in made:
        keep = received["keep"] > 0
        made[index] = _storage_on(received["fds"][index], nbytes, keep)
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
