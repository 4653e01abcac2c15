"""The guard: the small process the kernel starts, parent of the start process.

It never imports torch (so it is never what the OOM killer picks).  It is a child subreaper and
the parent of the start process; when the start process dies for any reason, or the kernel dies
(PR_SET_PDEATHSIG, asked before anything slow), the guard kills every process still below it --
ranks, and daemons that escaped from them and re-parented to it -- and exits.

The other way round, the guard killed (even by SIGKILL, or by a killpg of its process group):
the start process leads a process group of its own (set first thing after the fork, by both
sides), so no one killpg reaches both; and its PR_SET_PDEATHSIG towards the guard, asked before
it imports torch, is SIGTERM, on which it kills everything below it (it is a subreaper too:
escaped daemons are its children), removes its jobs' files and exits
(:meth:`taas.launch.local.starter.Starter.shutdown`); while it is still importing torch SIGTERM
just ends it, with nothing below it yet.  Not covered: the guard and the start process SIGKILLed
separately at the same instant -- nothing is left alive to clean up; only a PID namespace
(whose init's death kills all inside) would cover that.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from taas.launch.local import unix


def main(fd: int, kernel: int, become_starter: Callable[[int, int], None],
         watch: Callable[[int, int], None] | None = None) -> None:
    """Run as the guard of ``kernel``; the forked child calls ``become_starter(fd, guard_pid)``
    (the start process, :func:`taas.launch.local.starter.start_process`) and never returns.
    ``watch(start_pid, kernel)``: the guard's life from then on (default :func:`_watch`; a guard
    forked from a warm process execs a fresh one, :mod:`taas.launch.local.forkstart`)."""
    unix.prctl(unix.PR_SET_PDEATHSIG, signal.SIGTERM)  # first: the kernel may die at any moment
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
    if os.getppid() != kernel:  # it died before we asked
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is the kernel's
    unix.prctl(unix.PR_SET_CHILD_SUBREAPER, 1)
    guard = os.getpid()
    pid = os.fork()
    if pid:
        unix.setpgid(pid)  # also done by the child; whichever runs first
        os.close(fd)  # the kernel's channel is the start process's alone (EOF when it goes)
        (watch or _watch)(pid, kernel)
    # A process group of our own, first: one killpg must never reach the guard and us at once.
    unix.setpgid(0)
    # SIGTERM, not SIGKILL: a guard killed by SIGKILL can no longer clean up after us, so we
    # must (Starter.shutdown); until the Starter handles it, SIGTERM ends us at once (still
    # blocked here, so a guard that dies now is seen when it is unblocked, or by getppid).
    unix.prctl(unix.PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD})
    if os.getppid() != guard:
        os._exit(0)
    become_starter(fd, guard)


def _watch(starter: int, kernel: int) -> None:
    """The guard's life: wait until the start process exits or the kernel dies (SIGTERM),
    then kill everything below us and exit.  SIGTERM and SIGCHLD are blocked: sigwait.

    On SIGTERM the start process gets SIGTERM first and a moment to end its jobs and remove
    their files (it dies at once if it is still importing torch).  If the guard itself is
    killed, the start process gets the same SIGTERM from the kernel (PR_SET_PDEATHSIG, see
    :func:`main`) and cleans up alone."""
    unix.set_name("taas-guard")
    while True:
        if signal.sigwait({signal.SIGTERM, signal.SIGCHLD}) == signal.SIGTERM:
            break
        if unix.reaped(starter):  # it died (SIGKILL, OOM killer, or it ended): clean up after it
            unix.kill_all_children()
            os._exit(0)
    try:
        os.kill(starter, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 3.0
    while not unix.reaped(starter) and time.monotonic() < deadline:
        signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - time.monotonic()))
    unix.kill_all_children()
    if os.getppid() != kernel:  # the kernel died: what it made is ours to remove
        remove_kernel_trash(kernel)
    os._exit(0)


def remove_kernel_trash(kernel: int) -> None:
    """What the kernel (gone) left in the temporary directory: job directories it renamed away to
    remove in the background (:func:`taas.launch.local.jobdir.discard`) and could not finish, job
    directories the start process could not remove because we had to kill it mid-shutdown, and a
    cluster node's copy of the working directory its agent kept."""
    import glob
    import tempfile

    from taas.launch.local.jobdir import remove, remove_owned

    remove_owned(kernel)
    # A cluster node's copy of the notebook's working directory, when the "kernel" is a Ray
    # agent (taas.launch.ray.agent) that died without shutting down.
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"taas-workdir-{kernel}-*")):
        remove(path)


if __name__ == "__main__":
    # ``python -m taas.launch.local.guard START_PID KERNEL``: a forked guard that exec'd to be
    # small (taas.launch.local.forkstart); its parent-death signal, subreaper flag and blocked
    # signals came through the exec (the flag is set again: harmless, and sure).
    import sys

    unix.prctl(unix.PR_SET_CHILD_SUBREAPER, 1)
    _watch(int(sys.argv[1]), int(sys.argv[2]))
