"""The warm start process: forks a job's processes with torch already imported.

Why: the kernel must never fork itself (it may have touched CUDA, and it runs threads), and
starting ``python`` + ``import torch`` per rank costs over a second.  So the kernel starts this
process once (``python -m taas.launch.local.starter FD KERNEL_PID``: first the guard,
:mod:`taas.launch.local.guard`, which forks the start process); it imports torch and the rank
runtime, then waits.  For each job it forks the processes, which start in milliseconds with
everything imported.  It stays single-threaded so that fork is safe and a child can still enter
new namespaces (see :mod:`taas.workdir.storage`).  It talks to the kernel in the typed messages
of :mod:`taas.launch.local.protocol`.

Forking a process that holds torch costs ~15 ms per child here (page tables of ~700 MB), so
between jobs the start process keeps a few children *forked ahead* ("taas-ready" in ps): idle,
single-threaded, blocked on a private socket.  A job's process is handed to one of them (its
spec and pipe fds over that socket) and starts at once; the pool is refilled while the user
works.  Without a ready child it forks on demand.  What a child does before the job's entry
point runs is :mod:`taas.launch.local.child`.

Each child is the leader of its own process group, gets SIGKILL if the starter dies
(PR_SET_PDEATHSIG), and whatever it starts is ended with it: the starter is a child subreaper,
so orphans of a job re-parent here and are killed when the job ends.  The starter exits when
the kernel closes its end of the socket (kernel exit, crash, kill or restart), or the guard dies
or asks (SIGTERM), ending every running job first (:meth:`Starter.shutdown`).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from taas.launch.api import run_cleanups
from taas.launch.local import child, forksafe, guard, protocol, unix
from taas.launch.local.limits import raise_fd_limit
from taas.launch.local.protocol import (
    Message,
    Spawn,
    Spawned,
    SpawnError,
    Stop,
    Stopped,
)

log = logging.getLogger("taas.launch.local.starter")  # not __name__: run as __main__

# What every job needs, imported once here so that forked children start warm.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # DistributedDataParallel imports it on first use: 1.6 s per rank otherwise
    "torch.utils.data",
    "cloudpickle",
    "taas.rank.main",
)


class _Job:
    def __init__(self, job_id: str, job_dir: str):
        self.job_id = job_id
        self.job_dir = job_dir  # the kernel removes it; we do if the kernel died first
        self.live: dict[int, str] = {}  # pid -> key
        self.kill_at: float | None = None  # SIGKILL deadline once a stop was asked
        self.stop_asked = False
        self.cleanups: tuple = ()  # LaunchSpec.cleanups: run once every process ended, or at shutdown


class Starter:
    def __init__(self, conn: Connection, sock: socket.socket):
        self.conn = conn
        self.sock = sock
        self.jobs: dict[str, _Job] = {}
        self.parent = os.getppid()
        self.ready: dict[int, socket.socket] = {}  # pid -> socket of a child forked ahead
        # Children to fork ahead: TAAS_READY_HINT (a job host told the size of its kernel's last
        # job), else one per core up to 8; after a job, that job's size.
        hint = os.environ.get("TAAS_READY_HINT", "")
        self.ready_target = min(int(hint), 64) if hint.isdigit() and int(hint) > 0 else min(os.cpu_count() or 1, 8)
        # SIGCHLD wakes the loop at once (set_wakeup_fd), so exits are reported without delay.
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # The guard's SIGTERM (kernel gone or closing us): shut down cleanly, at once.
        self.terminated = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.private = (conn.fileno(), sock.fileno(), self.wakeup_r, wakeup_w)
        # What the kernel may ask, by message type; anything else is logged and ignored.
        self.handlers: dict[type, Callable] = {Spawn: self._on_spawn, Stop: self._on_stop}

    def _on_sigterm(self, *_) -> None:
        self.terminated = True

    # -- main loop -------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            if self.terminated:
                return self.shutdown()
            busy = any(job.kill_at is not None for job in self.jobs.values())
            ready = wait([self.conn, self.wakeup_r], timeout=0.05 if busy else 0.5)
            if self.wakeup_r in ready:
                _drain(self.wakeup_r)
            if self.conn in ready:
                try:
                    message = protocol.receive(self.conn)
                except (EOFError, OSError):
                    return self.shutdown()
                self._dispatch(message)
            self._reap()
            self._enforce_deadlines()
            if os.getppid() != self.parent:  # the kernel is gone
                return self.shutdown()
            if not any(job.live for job in self.jobs.values()):
                self._fork_ahead()  # between jobs: never compete with running ranks
            if not self.jobs and set(unix.child_pids()) - set(self.ready):
                self._kill_orphans()  # something of a finished job re-parented to us late

    def shutdown(self) -> None:
        """End every process below us -- jobs' processes, children forked ahead, and whatever
        escaped from a job and re-parented to us -- then remove what the jobs leave.  Reached
        when the kernel is gone or the guard asks (SIGTERM), and when the guard dies, even by
        SIGKILL: our parent-death signal is SIGTERM, so nothing below us outlives the guard."""
        for channel in self.ready.values():
            channel.close()  # EOF: a ready child exits (it is killed below anyway)
        # Until we have no child at all: a process killed now can still re-parent its own
        # children to us (a subreaper) as it dies; so wait for them too, not only the jobs'.
        unix.kill_all_children()
        self.ready.clear()
        for job in self.jobs.values():  # the kernel cannot clean up after itself any more
            shutil.rmtree(job.job_dir, ignore_errors=True)
        for job in list(self.jobs.values()):
            run_cleanups(job.cleanups)

    def _tell(self, message: Message) -> None:
        """Send to the kernel; if it is gone, the next recv sees EOF and shuts us down (a
        failed send must not skip the cleanup that shutdown() itself is doing)."""
        try:
            protocol.send(self.conn, message)
        except OSError:
            pass

    def _dispatch(self, message: Message | None) -> None:
        if message is None:
            return  # unreadable: protocol.decode logged it
        handler = self.handlers.get(type(message))
        if handler is None:
            log.warning("taas: the start process ignored a %s it does not expect", type(message).__name__)
            return
        handler(message)

    # -- messages --------------------------------------------------------------------------
    def _on_spawn(self, message: Spawn) -> None:
        job_id, cwd, specs = message.job_id, message.cwd, message.processes
        fds = protocol.recv_fds(self.sock, message.fds)
        own_count = len(protocol.STREAMS)
        shared_fds = fds[own_count * len(specs):]  # every process gets these (LaunchSpec.shared_fds)
        refused = forksafe.refusal()
        if refused is not None:  # never fork with CUDA initialised; a fresh start process will
            for fd in fds:
                os.close(fd)
            self._tell(SpawnError(job_id, refused, replace=True))
            self.terminated = True  # serve() shuts us down; the kernel starts a new one
            return
        job = self.jobs[job_id] = _Job(job_id, message.job_dir)
        job.cleanups = message.cleanups
        pids: dict[str, int] = {}
        starter = os.getpid()
        self.ready_target = min(max(len(specs), 1), 64)
        try:
            for i, spec in enumerate(specs):
                own = fds[own_count * i : own_count * (i + 1)] + shared_fds
                pid = self._hand_to_ready_child(spec, cwd, own)
                if pid is None:
                    pid = os.fork()
                    if pid == 0:  # child: never returns
                        child.run(spec, cwd, own, self._private(), starter)
                    try:
                        os.setpgid(pid, pid)  # also done by the child; whichever runs first
                    except OSError:
                        pass
                job.live[pid] = spec.key
                pids[spec.key] = pid
        except OSError as exc:
            self._signal_job(job, signal.SIGKILL)
            self._tell(SpawnError(job_id, f"could not start the job's processes: {exc}"))
            return
        finally:
            for fd in fds:
                os.close(fd)
        self._tell(Spawned(job_id, pids))

    # -- children forked ahead -------------------------------------------------------------
    def _private(self) -> tuple[int, ...]:
        """The fds a child must close: the kernel's channel, our wakeup pipe, ready sockets."""
        return self.private + tuple(ch.fileno() for ch in self.ready.values())

    def _fork_ahead(self) -> None:
        # Never fork with CUDA initialised (the next Spawn refuses and we are replaced).
        while len(self.ready) < self.ready_target and not self.conn.poll(0) and forksafe.refusal() is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            starter = os.getpid()
            pid = os.fork()
            if pid == 0:  # child: waits for a job, never returns
                ours.close()
                child.wait_ready(theirs, self._private(), starter)
            theirs.close()
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass
            self.ready[pid] = ours

    def _hand_to_ready_child(self, spec, cwd: str, fds: list[int]) -> int | None:
        message = protocol.encode(protocol.Become(spec, cwd))
        if self.ready and len(message) > protocol.ready_message_max(next(iter(self.ready.values()))):
            return None  # too big for one message (a loader worker carries its loader): fork on demand
        while self.ready:
            pid, channel = self.ready.popitem()
            try:
                socket.send_fds(channel, [message], fds)
                return pid
            except OSError:  # it died meanwhile: reaped as an unknown child
                unix.killpg(pid, signal.SIGKILL)
            finally:
                channel.close()
        return None

    def _on_stop(self, message: Stop) -> None:
        job = self.jobs.get(message.job_id)
        if job is None:
            self._tell(Stopped(message.job_id))
            return
        job.stop_asked = True
        self._signal_job(job, signal.SIGTERM)
        job.kill_at = time.monotonic() + message.grace
        self._maybe_finish(job)

    # -- bookkeeping -----------------------------------------------------------------------
    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.ready:  # a child forked ahead died before it was used
                self.ready.pop(pid).close()
                continue
            for job in list(self.jobs.values()):
                key = job.live.pop(pid, None)
                if key is None:
                    continue  # an orphan of some job that re-parented to us: reaped, done
                # Whatever this process started dies with it (its process group).
                unix.killpg(pid, signal.SIGKILL)
                self._tell(protocol.Exited(job.job_id, key, pid, os.waitstatus_to_exitcode(status)))
                self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if job.live:
            return
        self._kill_orphans()
        run_cleanups(job.cleanups)  # e.g. the data plane's shared memory (the kernel frees it too)
        if job.stop_asked:
            self._tell(Stopped(job.job_id))
        del self.jobs[job.job_id]

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for job in self.jobs.values():
            if job.kill_at is not None and now >= job.kill_at:
                self._signal_job(job, signal.SIGKILL)
                self._kill_orphans()
                job.kill_at = now + 0.5  # repeat until reaped

    def _signal_job(self, job: _Job, sig: int) -> None:
        for pid in job.live:
            unix.killpg(pid, sig)

    def _kill_orphans(self) -> None:
        """Kill every child that is not a live process of a job, with everything below it:
        orphans of finished ranks (a DataLoader worker that outlived its rank, a daemon that
        left its group with setsid or a double fork).  Killing one can re-parent its own
        children to us (we are a subreaper): repeat until no such child is left."""
        deadline = time.monotonic() + 2.0
        while True:
            live = {pid for job in self.jobs.values() for pid in job.live} | set(self.ready)
            orphans = [pid for pid in unix.child_pids() if pid not in live]
            if not orphans or time.monotonic() > deadline:
                return
            for pid in orphans:
                for victim in [pid, *unix.descendant_pids(pid)]:
                    unix.killpg(victim, signal.SIGKILL)
                    unix.kill(victim, signal.SIGKILL)
            time.sleep(0.005)
            for pid in orphans:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def start_process(fd: int, guard_pid: int) -> None:
    """The start process's life, in the child the guard forked (its own process group and
    parent-death SIGTERM already set, :func:`taas.launch.local.guard.main`)."""
    unix.set_name("taas-start")
    unix.prctl(unix.PR_SET_CHILD_SUBREAPER, 1)  # orphans of a job come to us first (killed at job end)
    forksafe.avoid_cuda_init()  # before torch: what we import must not initialise CUDA
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a child that needs it reports the ImportError itself, with its traceback
    # Everything imported so far lives as long as we do: keep the garbage collector of each
    # child from walking (and so copying) those pages.
    gc.freeze()
    raise_fd_limit()
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    protocol.send(conn, protocol.Ready(os.getpid()))
    Starter(conn, sock).serve()


def main() -> None:
    """``python -m taas.launch.local.starter FD KERNEL_PID``: the guard, which forks the start process."""
    guard.main(int(sys.argv[1]), int(sys.argv[2]), start_process)


if __name__ == "__main__":
    main()
