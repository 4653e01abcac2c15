"""A start process forked from a warm process instead of started as a fresh interpreter.

A fresh start process imports torch: over a second of CPU.  A process that has already imported
what the start process needs (:func:`preload`: a job host's zygote, :mod:`taas.host.zygote`) and
runs one thread can fork it instead, in milliseconds::

    warm process (one thread) ──fork──> guard ──fork──> start process (torch already imported)
                                          └─ exec: a fresh small interpreter that only watches
                                             (``python -I -S``, running ``taas.launch.local.guard``)

The guard keeps what it is when the launcher starts it as ``python -m taas.launch.local.starter``
(:mod:`taas.launch.local.guard`): the parent of the start process, a child subreaper with the
warm process's death as its parent-death signal, and a small process that never holds torch
(so never what the OOM killer picks): once it has forked the start process it ``exec``s, which
keeps its pid, children, parent-death signal, subreaper flag and blocked signals.

:class:`ForkedGuard` is to the launcher what the ``subprocess.Popen`` of a started guard is.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading
import time
import traceback

from taas.launch.local import forksafe, guard

ENV = "TAAS_FORK_START"  # "1": this process is warm, fork the start process (set by a zygote)


def preload() -> None:
    """Import what the start process imports, without initialising CUDA: a process that did
    this and runs one thread may fork start processes (:func:`fork_guard`)."""
    from taas.launch.local import starter

    forksafe.avoid_cuda_init()
    for name in starter.PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the start process's children report it, as for a fresh start process


def asked(environ=os.environ) -> bool:
    """Whether this process was told it is warm (``ENV``, taken out: not for its children)."""
    return environ.pop(ENV, "") == "1"


def may_fork() -> bool:
    """Fork the start process from this process (one that was :func:`asked`): it has torch,
    no CUDA context, and one thread (a fork of a process with other threads may copy a lock
    another thread held)."""
    return ("torch" in sys.modules and threading.active_count() == 1
            and not forksafe.cuda_initialized())


def fork_guard(fd: int, package_root: str) -> ForkedGuard:
    """Fork the guard (which forks the start process on ``fd``, the launcher's socket end)."""
    from taas.launch.local import starter

    parent = os.getpid()
    pid = os.fork()
    if pid:
        return ForkedGuard(pid)
    try:  # the child: never returns into the caller's frames
        os.setsid()  # as start_new_session: the kernel's interrupt is the kernel's
        _keep_only(fd)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        gc.freeze()  # the start process forks ranks: keep their collector off these pages too
        guard.main(fd, parent, starter.start_process,
                   watch=lambda start, kernel: _exec_watch(start, kernel, package_root))
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def _keep_only(fd: int) -> None:
    """Close every descriptor but the standard three and ``fd``: the warm process's sockets
    (a host's channel to its kernel, a zygote's) must not live on in the job's processes."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name in os.listdir("/proc/self/fd"):
        n = int(name)
        if n > 2 and n != fd:
            try:
                os.close(n)
            except OSError:
                pass  # the listing's own descriptor, already closed


def _exec_watch(starter_pid: int, kernel: int, package_root: str) -> None:
    """The guard's life, in a fresh small interpreter (the same process: exec).  Isolated and
    without ``site`` (``-I -S``): it needs the standard library and taas alone, and starts in
    half the time (no site-packages scan, no editable-install finders)."""
    code = (f"import sys; sys.path.insert(0, {package_root!r}); import runpy; "
            "runpy.run_module('taas.launch.local.guard', run_name='__main__', alter_sys=True)")
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", code, str(starter_pid), str(kernel)])


class ForkedGuard:
    """A forked guard, with what the launcher uses of ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["taas guard"], timeout or 0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
