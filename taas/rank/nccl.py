"""What an NCCL rank needs so that a fault or a stop never leaves it spinning in a collective.

* Before ``init_process_group`` (:func:`prepare_environment`): torch's async error handling on
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, torch 2.15's name; what torchelastic sets): the
  watchdog aborts the communicators and ends the rank when a collective fails or times out.
  NCCL's own log (``NCCL_DEBUG``) goes to the process's stdout, which the start process made
  this rank's tagged pipe; ``NCCL_DEBUG_FILE`` would send it past the cell, so it is dropped.
* On the stop path (:func:`install_stop`): the launcher's SIGTERM (a job stopped: interrupt,
  a failed peer) aborts the process groups, which frees a main thread blocked in a collective
  or a synchronize, then the rank dies of SIGTERM as before.  A Python signal handler alone
  would wait for that blocked main thread, so the signal also reaches a watcher thread through
  the wakeup fd, which Python's C-level handler writes at once.  The launcher's SIGKILL after
  its grace (:data:`taas.supervisor.supervisor.STOP_GRACE`) still covers an abort that hangs.

gloo ranks keep the default SIGTERM (immediate death): nothing here runs for them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable, MutableMapping

_state: dict = {}  # pid -> (read end of the wakeup pipe, the old wakeup fd): installed in that pid
_lock = threading.Lock()
_stopping = False  # a SIGTERM is being handled: the process groups are the stop path's
_leaving = False  # the rank tears its process groups down itself: a SIGTERM just ends it


def prepare_environment(environ: MutableMapping[str, str]) -> None:
    """The environment of an NCCL rank, before its process group is made."""
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # NCCL_DEBUG lines belong in the cell, tagged with the rank: NCCL writes them to stdout.
    environ.pop("NCCL_DEBUG_FILE", None)


def leaving() -> bool:
    """The rank is about to tear down its process groups itself (:func:`taas.rank.main._teardown`):
    from now on a SIGTERM ends it without touching them.  False if a SIGTERM's abort got there
    first: then the groups are the stop path's, and the rank must leave them alone."""
    global _leaving
    with _lock:
        _leaving = True
        return not _stopping


def abort_process_groups() -> None:
    """Abort every process group of this rank (NCCL: ends its communicators and their kernels,
    so a collective in flight returns at once instead of spinning)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        return
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
        return
    for group in list(c10d._world.pg_map):  # an older torch: each group's own abort
        group_abort = getattr(group, "abort", None)
        if group_abort is not None:
            group_abort()


def install_stop(abort: Callable[[], None] = abort_process_groups,
                 die: Callable[[], None] | None = None) -> None:
    """On SIGTERM: ``abort()``, then ``die()`` (by default: death by SIGTERM, as without this).
    Called in the rank's main thread; forked children (DataLoader workers) forget it."""
    global _stopping, _leaving
    die = die or _die_of_sigterm
    _stopping = _leaving = False
    read, write = os.pipe()
    os.set_blocking(write, False)  # what set_wakeup_fd requires
    old = signal.set_wakeup_fd(write)
    _state[os.getpid()] = (read, old)

    def stop() -> None:
        global _stopping
        with _lock:  # the handler and the watcher may both see the same SIGTERM
            if _stopping:
                return
            _stopping = True
            aborting = not _leaving  # never abort groups that the main thread is destroying
        try:
            if aborting:
                abort()
        except Exception:  # we are stopping: whatever the abort says, die as asked
            pass
        die()

    def on_sigterm(signum, frame) -> None:
        if os.getpid() != owner:  # a fork of the rank that kept our handler
            _die_of_sigterm()
        stop()

    def watch() -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                stop()
                return

    owner = os.getpid()
    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=watch, name="taas-nccl-stop", daemon=True).start()


_blocked_for_fork = False


def _before_fork() -> None:
    """A fork of the rank (a DataLoader worker) is born with SIGTERM blocked, until it forgot
    our handler and the shared wakeup pipe (:func:`_forget_in_child`): a SIGTERM it gets at
    once must end it alone, never reach the rank's watcher."""
    global _blocked_for_fork
    if os.getpid() in _state:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _blocked_for_fork = True


def _after_fork_in_parent() -> None:
    global _blocked_for_fork
    if _blocked_for_fork:
        _blocked_for_fork = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _forget_in_child() -> None:
    global _blocked_for_fork
    if not _state or os.getpid() in _state:
        return
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # forked from a thread other than the main one
        pass
    _state.clear()
    if _blocked_for_fork:
        _blocked_for_fork = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_forget_in_child)


def _die_of_sigterm() -> None:
    """Die of SIGTERM, as a rank without this module does (exit status -15), from any thread:
    the C library's signal() (Python's signal.signal works only in the main thread)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        os._exit(128 + signal.SIGTERM)
