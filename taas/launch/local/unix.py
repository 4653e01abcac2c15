"""The Linux process calls the guard, the start process and its children share.

prctl (parent-death signal, name, subreaper), process groups, and killing or reaping whatever
is below the calling process.  Nothing here imports torch: the guard uses it too.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value) -> None:
    _libc.prctl(option, value, 0, 0, 0)


def set_name(name: str) -> None:
    """What ps/psutil show as this process's name (comm)."""
    prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def setpgid(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of a process group of its own."""
    try:
        os.setpgid(pid, 0)
    except OSError:  # the other side did it first, or the child is already gone
        pass


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def child_pids() -> list[int]:
    """Our children (the start process is single-threaded: one task)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:  # pragma: no cover - kernels without CONFIG_PROC_CHILDREN
        import psutil

        return [child.pid for child in psutil.Process().children()]


def descendant_pids(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def reaped(pid: int) -> bool:
    """Reap every exited child; whether ``pid`` was one of them."""
    found = False
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if done == 0:
            return found
        found = found or done == pid


def kill_all_children() -> None:
    """SIGKILL every child (and its process group) until none is left.  We are a subreaper,
    so whatever still runs below us re-parents to us as its parents die; once we have no
    child at all, nothing is left below us."""
    import psutil

    while True:
        for child in psutil.Process().children():
            killpg(child.pid, signal.SIGKILL)
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            pass
