"""The local launcher's job directory: where its processes find the job's files and leave
theirs (the process side of :mod:`taas.launch.api`).

    <tmp>/taas-job-<owner pid>-<job_id>-XXXX/
        payload.pkl ...           LaunchSpec.files
        rank1.error.json          a process's failure report       (api.error_name)
        rank1.fault               its fault dump                    (api.fault_name)
        result.pkl                rank 0's results                  (api.RESULT)
        stacks/<key>              FIFO: "where are you?"            (taas.launch.process.stacks)
        scratch/rank<r>/          a rank's own writable directory   ($TAAS_SCRATCH)
        layer/<key>/upper         a rank's --storage layer          (taas.workdir.storage)

Only the launcher knows this layout; the kernel reads results through ``JobHandle.fetch``.

The owner (the process whose launcher made the job: a kernel, or a job host) removes the
directory when the job is over; the start process removes it if the owner died first; and if
both died mid-way, the guard (:func:`taas.launch.local.guard.remove_kernel_trash`) or the next
launcher on this machine (:func:`sweep`) removes it: the owner's pid is in the name.
"""

from __future__ import annotations

import atexit
import glob
import os
import queue
import re
import shutil
import tempfile
import threading

from taas.errors import LaunchError


_JOB = "taas-job-"


def create(job_id: str) -> str:
    try:
        return tempfile.mkdtemp(prefix=f"{_JOB}{os.getpid()}-{job_id}-")
    except OSError as exc:
        raise no_room("create the job's directory", exc) from None


def write_files(job_dir: str, files: dict[str, bytes]) -> None:
    try:
        for name, data in files.items():
            with open(os.path.join(job_dir, name), "wb") as f:
                f.write(data)
    except OSError as exc:
        raise no_room("write the job's files", exc) from None


def scratch(job_dir: str, rank: int) -> str:
    path = os.path.join(job_dir, "scratch", f"rank{rank}")
    try:
        os.makedirs(path)
    except OSError as exc:
        raise no_room("write the job's files", exc) from None
    return path


def read(job_dir: str, name: str) -> bytes | None:
    try:
        with open(os.path.join(job_dir, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def layers(job_dir: str) -> list[tuple[str, str]]:
    """``(directory name, upper path)`` of every layer the job's processes made."""
    root = os.path.join(job_dir, "layer")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [(name, os.path.join(root, name, "upper")) for name in names
            if os.path.isdir(os.path.join(root, name, "upper"))]


def remove(path: str) -> None:
    """``rm -rf path``, also through directories without permissions (overlayfs leaves its
    work directory ``d---------``, owned by the rank's user).  Permissions are changed only
    inside ``path``: never on the temporary directory that holds it."""
    top = os.path.abspath(path)

    def retry(func, p, _exc):
        parent = os.path.dirname(os.path.abspath(p))
        if not (parent == top or parent.startswith(top + os.sep)):
            return  # ``path`` itself is gone or cannot be removed: nothing of ours to fix
        try:
            os.chmod(parent, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


_TRASH = "taas-trash-"
_pending: queue.Queue = queue.Queue()
_remover: threading.Thread | None = None
_lock = threading.Lock()


def discard(path: str) -> None:
    """Remove ``path`` without making the caller wait: it is renamed at once (gone under its
    own name), and a background thread removes it.  On a disk mounted with ``discard`` each
    unlink and rmdir costs milliseconds, and a job directory holds a few dozen entries: 50-100
    ms that a cell would otherwise wait for."""
    global _remover
    trash = os.path.join(os.path.dirname(path), f"{_TRASH}{os.getpid()}-{os.path.basename(path)}")
    try:
        os.rename(path, trash)
    except OSError:
        remove(path)  # gone already, or not renamable: do it here
        return
    _pending.put(trash)
    with _lock:
        if _remover is None or not _remover.is_alive():
            _remover = threading.Thread(target=_remove_pending, name="taas-jobdir-remover", daemon=True)
            _remover.start()


def _remove_pending() -> None:
    while True:
        path = _pending.get()
        try:
            remove(path)
        finally:
            _pending.task_done()


def flush() -> None:
    """Wait until every discarded directory is removed."""
    _pending.join()


def sweep() -> None:
    """Remove what an owner that died left: its trash, and job directories that no one
    removed because its start process died with it (its pid is in both names)."""
    import psutil

    for prefix in (_TRASH, _JOB):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")):
            match = re.match(r"(\d+)-", os.path.basename(path)[len(prefix):])
            if match and not psutil.pid_exists(int(match.group(1))):
                remove(path)


def remove_owned(owner: int) -> None:
    """Remove every job directory (and trash) of ``owner``, a process that is gone."""
    for prefix in (_TRASH, _JOB):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}{owner}-*")):
            remove(path)


atexit.register(flush)


def no_room(what: str, exc: OSError) -> LaunchError:
    """The one line for a job whose files cannot go to the temporary directory."""
    return LaunchError(f"cannot {what} in {tempfile.gettempdir()}: {exc.strerror or exc}; free space "
                       "there, or set TMPDIR to a writable directory and restart the kernel")
