"""What one machine can hold: open files and GPUs, checked before a job starts.

Each check raises :class:`~taas.errors.LaunchError` in one line, so the user learns why a job
cannot start here (and what to change) instead of a half-started job.
"""

from __future__ import annotations

import os

from taas.errors import LaunchError
from taas.launch.api import cuda_device_count
from taas.launch.local.protocol import FDS_PER_MESSAGE, MAX_SHARED_FDS, STREAMS

# Open files the kernel needs per process of a job while it runs: three pipe ends, and the
# process's connection to the kernel-hosted rendezvous store.
_FDS_PER_PROCESS = 4
_FD_MARGIN = 64  # what the kernel itself may open meanwhile


def check_gpus(ranks: int) -> None:
    """One rank per GPU on this machine."""
    count = cuda_device_count()
    if ranks > count:
        raise LaunchError(f"--gpus {ranks} asks for more GPUs than this machine has ({count}); "
                          "for more GPUs, run it on a Ray cluster (%taas cluster ADDRESS, or --cluster ADDRESS)")


def check_shared_fds(count: int) -> None:
    """A job's shared files go to a child forked ahead in one message, with its own pipes."""
    if count > MAX_SHARED_FDS:
        raise LaunchError(f"a job can pass at most {MAX_SHARED_FDS} shared files to its processes, "
                          f"not {count}")


def _fds_needed(processes: int) -> int:
    """Extra open files the kernel holds for a job of ``processes`` processes, at the peak:
    while starting, every read end plus one batch of write ends; while running, the read ends
    and each process's store connection."""
    streams = len(STREAMS) * processes
    return max(streams + min(streams, FDS_PER_MESSAGE), _FDS_PER_PROCESS * processes)


def check_fd_limit(processes: int) -> None:
    """Refuse, in one line, a job whose pipes would not fit under the kernel's open-file limit
    (raising the soft limit towards the hard one first, as far as the job needs)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    need = open_now + _fds_needed(processes) + _FD_MARGIN
    if need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
        except (ValueError, OSError):
            pass
    limit = max(soft, hard)
    fit = processes
    while fit > 0 and open_now + _fds_needed(fit) + _FD_MARGIN > limit:
        fit -= 1
    raise LaunchError(
        f"a job of {processes} processes needs about {need} open files in the kernel, but its "
        f"limit is {limit}: use at most {fit} processes (ranks plus loader workers), or raise "
        "the limit (ulimit -n) before starting Jupyter")


def raise_fd_limit() -> None:
    """In the start process: each process of a job holds three pipe ends, and a gloo rank a
    socket per peer: let the start process (and so every child) open as many files as the hard
    limit allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
