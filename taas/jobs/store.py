"""The job records on disk (api.py says what is in one): create, read, list, mark lost, forget.

Private to their user: the records' folder and each record are 0700, and a folder that others
may read or that another user owns is refused in one line.  Every write replaces a whole file
(write a temporary file, fsync, rename), so a crash leaves the old record or the new one; a
record that cannot be read anyway (a disk full, a hand edit) is reported, never fatal, and
touches nothing of another job.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator

from taas.errors import TaasError
from taas.jobs import api
from taas.jobs.api import JobRecord, Listed, State

_ID = re.compile(r"^[0-9a-f]{6,32}$")


class JobError(TaasError):
    """A job record asked for cannot be used: unknown, ambiguous, unreadable, or not yours."""


def new_id() -> str:
    return uuid.uuid4().hex[:6]


def resolve_id(prefix: str, ids, *, where: str = "here", lister: str = "`taas jobs`") -> str:
    """The id a user typed among ``ids``: a whole id or an unambiguous prefix of one; else one
    line saying what is wrong (``where``: where the jobs are; ``lister``: what lists them)."""
    prefix = prefix.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", prefix):
        raise JobError(f"taas: {prefix!r} is not a job id (ids look like 7f3a2c); {lister} lists yours")
    matches = [name for name in ids if name.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise JobError(f"taas: no job {prefix!r} {where}; {lister} lists yours")
    raise JobError(f"taas: {prefix!r} names {len(matches)} jobs ({', '.join(sorted(matches))}); "
                   "type more of the id")


class Store:
    """This user's job records under ``root`` (default: :func:`api.default_root`)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = pathlib.Path(root) if root is not None else api.default_root()

    # -- the folder ------------------------------------------------------------------------
    def _checked_root(self, create: bool) -> pathlib.Path | None:
        root = self.root
        if create:
            old = os.umask(0o077)
            try:
                root.mkdir(parents=True, exist_ok=True, mode=0o700)
            finally:
                os.umask(old)
        try:
            info = root.stat()
        except FileNotFoundError:
            return None
        if info.st_uid != os.getuid():
            raise JobError(f"taas: the job records folder {root} belongs to another user (uid "
                           f"{info.st_uid}); set TAAS_HOME to a folder of your own")
        if stat.S_IMODE(info.st_mode) & 0o077:
            if create:
                os.chmod(root, 0o700)
            else:
                raise JobError(f"taas: the job records folder {root} can be read by others (mode "
                               f"{stat.S_IMODE(info.st_mode):o}); run: chmod 700 {root}")
        return root

    def ensure(self) -> pathlib.Path:
        """The records' folder, made (0700) if missing; refused if another user's or readable by others."""
        root = self._checked_root(create=True)
        assert root is not None
        return root

    def folder(self, job_id: str) -> pathlib.Path:
        return self.root / job_id

    def create(self, record: JobRecord) -> pathlib.Path:
        """A new record's folder, with ``record`` in it; the id must be new."""
        path = self.ensure() / record.id
        path.mkdir(mode=0o700)
        (path / api.OUT).mkdir(mode=0o700)
        (path / api.LOCK).touch(mode=0o600)
        self.write(record)
        return path

    # -- one record --------------------------------------------------------------------------
    def write(self, record: JobRecord) -> None:
        write_file(self.folder(record.id) / api.RECORD, json.dumps(record.to_json(), indent=1).encode())

    def put(self, job_id: str, name: str, data: bytes) -> None:
        """One of the record's files (results, failure), replaced whole."""
        write_file(self.folder(job_id) / name, data)

    def get(self, job_id: str, name: str) -> bytes | None:
        """One of the record's files, or None when it is not there."""
        try:
            return (self.folder(job_id) / name).read_bytes()
        except OSError:
            return None

    def claim(self, job_id: str, name: str) -> bytes | None:
        """One of the record's files, once: whoever renames it first has it (None: claimed
        already, or never there)."""
        folder = self.folder(job_id)
        mine = folder / f".{name}-{os.getpid()}-{threading.get_ident()}"
        try:
            os.rename(folder / name, mine)  # the one atomic claim
        except FileNotFoundError:
            return None
        try:
            return mine.read_bytes()
        finally:
            os.unlink(mine)

    def read(self, job_id: str) -> JobRecord:
        """The record of ``job_id`` as it is now: a running job whose host is gone reads LOST
        (and is written so).  Raises JobError with one line when there is no such record or it
        cannot be read."""
        self._checked_root(create=False)
        path = self.folder(job_id)
        if not _ID.match(job_id) or not path.is_dir():
            raise JobError(f"taas: no job {job_id!r} here; `taas jobs` lists yours")
        try:
            record = JobRecord.from_json(json.loads((path / api.RECORD).read_bytes()))
        except FileNotFoundError:
            raise JobError(f"taas: job {job_id}'s record is missing (its host may be writing it "
                           f"now, or it was removed); `taas forget {job_id}` drops what is left") from None
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise JobError(f"taas: job {job_id}'s record is damaged ({type(exc).__name__}: {exc}); "
                           f"`taas forget {job_id}` removes it") from None
        try:
            record = record.replace(taken=(path / api.TAKEN).stat().st_mtime)
        except FileNotFoundError:
            pass
        return self._lost_if_orphaned(record)

    def resolve(self, prefix: str) -> str:
        """The id a user typed: a whole id or an unambiguous prefix of one."""
        return resolve_id(prefix, self.ids())

    def ids(self) -> list[str]:
        root = self._checked_root(create=False)
        if root is None:
            return []
        return sorted(entry.name for entry in root.iterdir() if entry.is_dir() and _ID.match(entry.name))

    def listing(self, prune: bool = True) -> list[Listed]:
        """Every record, newest first; finished ones older than the age limit are removed first."""
        out = []
        limit = api.max_age()
        for job_id in self.ids():
            path = self.folder(job_id)
            try:
                record = self.read(job_id)
            except JobError as exc:
                out.append(Listed(JobRecord(job_id, State.LOST, 0, "", _mtime(path)),
                                  size=_size(path), problem=str(exc)))
                continue
            if prune and record.state.final and record.ended and time.time() - record.ended > limit:
                self.remove(job_id)
                continue
            out.append(Listed(record, size=_size(path)))
        out.sort(key=lambda item: item.record.started, reverse=True)
        return out

    def remove(self, job_id: str) -> None:
        """Remove a record's folder (``taas forget``); a running job's record is refused."""
        path = self.folder(job_id)
        if not _ID.match(job_id) or not path.is_dir():
            raise JobError(f"taas: no job {job_id!r} here; `taas jobs` lists yours")
        try:
            record: JobRecord | None = self.read(job_id)
        except JobError:  # a damaged record: forgetting it is how it goes
            record = None
        if record is not None and not record.state.final:
            raise JobError(f"taas: job {job_id} is {record.state.value}; `taas cancel {job_id}` "
                           "first, then forget it")
        # Renamed away first: a reader never sees half a folder under the job's id.
        gone = path.with_name(f".gone-{job_id}-{os.getpid()}")
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    # -- the host's lock -------------------------------------------------------------------
    @contextlib.contextmanager
    def host_gone(self, job_id: str) -> Iterator[bool]:
        """Whether no host holds ``job_id``'s lock, holding it meanwhile if so (then no host can
        start or write the record until the block ends)."""
        try:
            # Read-only: a viewer that follows the job (jobs/watch.py) looks at the lock at each
            # change, and closing a file opened for writing is itself a change it would wake for.
            fd = os.open(self.folder(job_id) / api.LOCK, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _lost_if_orphaned(self, record: JobRecord) -> JobRecord:
        if record.state.final:
            return record
        with self.host_gone(record.id) as gone:
            if not gone:
                return record
            # Read again under the lock: the host may have finished between the two reads.
            try:
                fresh = JobRecord.from_json(json.loads((self.folder(record.id) / api.RECORD).read_bytes()))
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                fresh = record
            if fresh.state.final:
                return fresh
            lost = fresh.replace(state=State.LOST, ended=time.time(), cause=(
                f"its supervisor (pid {fresh.host_pid}) ended without a word: killed, or the "
                "machine restarted; its ranks ended with it"))
            self.write(lost)
            return lost


def hold_lock(folder: pathlib.Path) -> int:
    """The host's side of the lock: an fd holding ``folder``'s lock for the caller's life."""
    fd = os.open(folder / api.LOCK, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def write_file(path: pathlib.Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` whole: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _size(path: pathlib.Path) -> int:
    total = 0
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            if entry.is_file():
                total += entry.stat().st_size
    return total


def _mtime(path: pathlib.Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
