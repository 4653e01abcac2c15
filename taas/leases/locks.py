"""The lock directory: one file per GPU, ``flock``-ed by whoever leases it, and the line.

    $TAAS_LEASE_DIR (default /tmp/taas-leases), mode 1777 like /tmp: any user creates files
    in it, no user removes another's (the sticky bit)
        gpu-<UUID>.lock     0666; an exclusive flock while leased; the holder's record inside
        queue/<name>.ticket a request in line: flock-ed by the waiter while it waits

A lease is the flock, and the flock belongs to the open file description: every process that
has the fd (the kernel that took it, the start process passing it, every rank it went to, and
their children) holds the lease, and it goes when the last of them closes it or dies, SIGKILL
included.  Nothing is ever unlocked by hand and no record is trusted on its own: a GPU is
leased exactly while its file's lock is held, and a ticket is in line exactly while its
waiter's lock on it is held (a record a dead process left is ignored, never waited on).
Works across users of the machine and across containers that share the directory (flock on
one file system; container PIDs are only shown, never used).

Taking is all or nothing and never blocks: each GPU's lock with LOCK_NB, lowest index first,
and on the first one held by someone else every lock taken so far is let go.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Mapping

from taas.leases.api import Holder, Ticket

ENV = "TAAS_LEASE_DIR"
DEFAULT = "/tmp/taas-leases"
_RECORD_MAX = 4096
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def lock_dir(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(ENV) or DEFAULT


def ensure(path: str) -> None:
    """Create the lock directory (and its queue) shared by every user: mode 1777.  One another
    user created is used as it is."""
    for folder in (path, os.path.join(path, "queue")):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o1777)
        info = os.lstat(folder)  # a symlink planted there is not our directory
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", folder)
        if info.st_uid == os.geteuid():
            if mode != 0o1777:
                os.chmod(folder, 0o1777)  # mkdir's mode went through our umask
        elif mode & 0o1002 != 0o1002:  # another user's, not writable by all with the sticky bit
            raise PermissionError(errno.EACCES, f"uid {info.st_uid}'s, mode {mode:o}, not shared (1777)",
                                  folder)


def _open(path: str, create: bool = True) -> int:
    """An fd on ``path`` (created 0666 so that any user can lock and write it); read-only when
    another user's file is not writable for us (a lock needs no write access)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY | flags & ~os.O_CREAT)
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o666:
        os.fchmod(fd, 0o666)  # the creation mode went through our umask
    return fd


def gpu_file(path: str, uuid: str) -> str:
    return os.path.join(path, f"gpu-{_SAFE.sub('_', uuid)}.lock")


def _write_record(fd: int, data: dict) -> None:
    with contextlib.suppress(OSError):  # a file we may only read: the lock is what counts
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(data).encode()[:_RECORD_MAX], 0)


def _read_record(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, _RECORD_MAX, 0) or b"null")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _locked_by_someone(fd: int) -> bool:
    """Whether any open file description (ours included) holds a lock on this file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class Lease:
    """GPUs leased: an open, locked fd per GPU.  Whoever has these fds (passed to a job's
    processes as shared fds) holds the lease; :meth:`close` lets go of this process's copies."""

    def __init__(self, uuids: tuple[str, ...], fds: tuple[int, ...]):
        self.uuids = uuids
        self.fds = fds

    def env(self) -> dict[str, str]:
        """The ranks' environment: only the leased GPUs visible, in rank order (rank r's
        ``cuda:LOCAL_RANK`` is the r-th GPU of the lease)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.uuids)}

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        """A lease dropped without close (an interrupt between its taking and its keeping)
        lets go of this process's copies then, not when the process ends."""
        with contextlib.suppress(Exception):  # at interpreter exit, os may be gone already
            self.close()


def try_take(path: str, uuids: Iterable[str], holder: Holder) -> Lease | None:
    """Lease every GPU of ``uuids`` (in this order) or none; never blocks."""
    taken: list[int] = []
    names = tuple(uuids)
    try:
        for uuid in names:
            fd = _open(gpu_file(path, uuid))
            taken.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        for fd in taken:
            os.close(fd)
        return None
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    for uuid, fd in zip(names, taken):
        _write_record(fd, {**holder.as_dict(), "uuid": uuid})
    return Lease(names, tuple(taken))


def held(path: str) -> dict[str, Holder]:
    """Every GPU leased now (by UUID) and its holder, as its record says; a GPU whose lock is
    free is not leased, whatever its file says.  The holder of a lease taken a moment ago may
    still read as the one before (the record follows the lock)."""
    out: dict[str, Holder] = {}
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return out
    for name in names:
        if not (name.startswith("gpu-") and name.endswith(".lock")):
            continue
        try:
            fd = _open(os.path.join(path, name), create=False)
        except OSError:
            continue
        try:
            if _locked_by_someone(fd):
                record = _read_record(fd)
                uuid = record.get("uuid") if isinstance(record.get("uuid"), str) else None
                out[uuid or name[len("gpu-"):-len(".lock")]] = Holder.from_dict(record)
        finally:
            os.close(fd)
    return out


class Place:
    """This request's place in line: a ticket file, locked while we wait.  Names sort in
    arrival order (nanoseconds, then pid and a random part to break ties)."""

    def __init__(self, path: str, count: int, holder: Holder):
        queue = os.path.join(path, "queue")
        self.name = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        draft = os.path.join(queue, f".{self.name}.draft")
        self.file = os.path.join(queue, f"{self.name}.ticket")
        self.fd = _open(draft)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # ours: no one else has this file yet
            _write_record(self.fd, {"count": count, "holder": holder.as_dict()})
            os.rename(draft, self.file)  # in line only once it is locked
        except BaseException:
            self.close(draft)
            raise

    def close(self, file: str | None = None) -> None:
        """Leave the line (the file first, then the lock: never an unlocked ticket of ours)."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file or self.file)
        os.close(self.fd)
        self.fd = -1


def line(path: str) -> list[Ticket]:
    """The live requests in line, first come first; a ticket whose lock is free belongs to a
    request that ended or died: ignored (and removed when it is ours to remove)."""
    queue = os.path.join(path, "queue")
    try:
        found = os.listdir(queue)
    except FileNotFoundError:
        return []
    _sweep_drafts(queue, [n for n in found if n.endswith(".draft")])
    names = sorted(n for n in found if n.endswith(".ticket"))
    out = []
    for name in names:
        file = os.path.join(queue, name)
        try:
            fd = _open(file, create=False)
        except OSError:
            continue
        try:
            if not _locked_by_someone(fd):
                try:
                    os.unlink(file)  # a dead waiter's; the sticky bit keeps others' (EPERM)
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EACCES, errno.ENOENT):
                        raise
                continue
            record = _read_record(fd)
            count = record.get("count")
            out.append(Ticket(name[: -len(".ticket")], count if isinstance(count, int) else 1,
                              Holder.from_dict(record.get("holder"))))
        finally:
            os.close(fd)
    return out


DRAFT_AGE = 600.0  # seconds: a draft ticket this old was left by a waiter killed as it wrote it


def _sweep_drafts(queue: str, names: list[str]) -> None:
    """Remove the drafts that waiters killed between creating and publishing their ticket left
    (never in line; only garbage), when they are ours to remove and long unlocked."""
    for name in names:
        file = os.path.join(queue, name)
        with contextlib.suppress(OSError):
            fd = _open(file, create=False)
            try:
                if time.time() - os.fstat(fd).st_mtime > DRAFT_AGE and not _locked_by_someone(fd):
                    os.unlink(file)
            finally:
                os.close(fd)
