"""The warm start process: forks a job's processes with torch already imported.

Why: the kernel must never fork itself (it may have touched CUDA, and it runs threads), and
starting ``python`` + ``import torch`` per rank costs over a second.  So the kernel starts this
process once (``python -m taas.launch.local.starter``); it imports torch and the rank runtime, then
waits.  For each job it forks the processes, which start in milliseconds with everything
imported.  It stays single-threaded so that fork is safe and a child can still enter new
namespaces (see :mod:`taas.workdir.storage`).

Protocol, over a private Unix socketpair inherited from the kernel (no address anyone else
can reach; pickles only ever cross between these two processes)::

    kernel -> starter   ("spawn", job_id, cwd, job_dir, [ProcessSpec...], shared, cleanups)
                        (shared: the number of LaunchSpec.shared_fds; cleanups: its hooks, run
                        when the job is over or the kernel died)  then, as ancillary data
                        on the same socket, three write-end fds per process
                        (stdout, stderr, events)
    starter -> kernel   ("spawned", job_id, {key: pid})  or  ("error", job_id, message)
    starter -> kernel   ("exit", job_id, key, pid, returncode)     once per process
    kernel -> starter   ("stop", job_id, grace)
    starter -> kernel   ("stopped", job_id)                        once every process is gone

Forking a process that holds torch costs ~15 ms per child here (page tables of ~700 MB), so
between jobs the start process keeps a few children *forked ahead* ("taas-ready" in ps): idle,
single-threaded, blocked on a private socket.  A job's process is handed to one of them (its
spec and pipe fds over that socket) and starts at once; the pool is refilled while the user
works.  Without a ready child it forks on demand.

Each child is the leader of its own process group, gets SIGKILL if the starter dies
(PR_SET_PDEATHSIG), and whatever it starts is ended with it: the starter is a child subreaper,
so orphans of a job re-parent here and are killed when the job ends.  The starter exits when
the kernel closes its end of the socket (kernel exit, crash, kill or restart), ending every
running job first.

Above the starter sits a small *guard* (see :func:`main`): the process the kernel starts.  It
never imports torch, dies with the kernel, and when the starter dies -- even by SIGKILL, as
the OOM killer would -- it kills whatever escaped from the jobs and re-parented to it.  When
the guard dies, even by SIGKILL, the starter gets SIGTERM (its parent-death signal) and ends
everything below it before it exits.

Fds travel in batches of at most FDS_PER_MESSAGE (one SCM_RIGHTS message carries 253 at most).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import pickle
import shutil
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait

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

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value) -> None:
    _libc.prctl(option, value, 0, 0, 0)


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
        self.ready_target = min(os.cpu_count() or 1, 8)  # then: the last job's size
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
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return self.shutdown()
                getattr(self, "_on_" + message[0])(*message[1:])
            self._reap()
            self._enforce_deadlines()
            if os.getppid() != self.parent:  # the kernel is gone
                return self.shutdown()
            if not any(job.live for job in self.jobs.values()):
                self._fork_ahead()  # between jobs: never compete with running ranks
            if not self.jobs and set(_child_pids()) - set(self.ready):
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
        _kill_all_children()
        self.ready.clear()
        for job in self.jobs.values():  # the kernel cannot clean up after itself any more
            shutil.rmtree(job.job_dir, ignore_errors=True)
        for job in list(self.jobs.values()):
            _run_cleanups(job.cleanups)

    def _tell(self, message: tuple) -> None:
        """Send to the kernel; if it is gone, the next recv sees EOF and shuts us down (a
        failed send must not skip the cleanup that shutdown() itself is doing)."""
        try:
            self.conn.send(message)
        except OSError:
            pass

    # -- messages --------------------------------------------------------------------------
    def _on_spawn(self, job_id: str, cwd: str, job_dir: str, specs: list, shared: int = 0,
                  cleanups: tuple = ()) -> None:
        fds = _recv_fds(self.sock, 3 * len(specs) + shared)
        shared_fds = fds[3 * len(specs):]  # every process gets these (LaunchSpec.shared_fds)
        job = self.jobs[job_id] = _Job(job_id, job_dir)
        job.cleanups = cleanups
        pids: dict[str, int] = {}
        starter = os.getpid()
        self.ready_target = min(max(len(specs), 1), 64)
        try:
            for i, spec in enumerate(specs):
                own = fds[3 * i : 3 * i + 3] + shared_fds
                pid = self._hand_to_ready_child(spec, cwd, own)
                if pid is None:
                    pid = os.fork()
                    if pid == 0:  # child: never returns
                        _child(spec, cwd, own, self._private(), starter)
                    try:
                        os.setpgid(pid, pid)  # also done by the child; whichever runs first
                    except OSError:
                        pass
                job.live[pid] = spec.key
                pids[spec.key] = pid
        except OSError as exc:
            self._signal_job(job, signal.SIGKILL)
            self._tell(("error", job_id, f"could not start the job's processes: {exc}"))
            return
        finally:
            for fd in fds:
                os.close(fd)
        self._tell(("spawned", job_id, pids))

    # -- children forked ahead -------------------------------------------------------------
    def _private(self) -> tuple[int, ...]:
        """The fds a child must close: the kernel's channel, our wakeup pipe, ready sockets."""
        return self.private + tuple(ch.fileno() for ch in self.ready.values())

    def _fork_ahead(self) -> None:
        while len(self.ready) < self.ready_target and not self.conn.poll(0):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            starter = os.getpid()
            pid = os.fork()
            if pid == 0:  # child: waits for a job, never returns
                ours.close()
                _ready_child(theirs, self._private(), starter)
            theirs.close()
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass
            self.ready[pid] = ours

    def _hand_to_ready_child(self, spec, cwd: str, fds: list[int]) -> int | None:
        message = pickle.dumps((spec, cwd))
        if self.ready and len(message) > _ready_message_max(next(iter(self.ready.values()))):
            return None  # too big for one message (a loader worker carries its loader): fork on demand
        while self.ready:
            pid, channel = self.ready.popitem()
            try:
                socket.send_fds(channel, [message], fds)
                return pid
            except OSError:  # it died meanwhile: reaped as an unknown child
                _killpg(pid, signal.SIGKILL)
            finally:
                channel.close()
        return None

    def _on_stop(self, job_id: str, grace: float) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            self._tell(("stopped", job_id))
            return
        job.stop_asked = True
        self._signal_job(job, signal.SIGTERM)
        job.kill_at = time.monotonic() + grace
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
                _killpg(pid, signal.SIGKILL)
                self._tell(("exit", job.job_id, key, pid, os.waitstatus_to_exitcode(status)))
                self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if job.live:
            return
        self._kill_orphans()
        _run_cleanups(job.cleanups)  # e.g. the data plane's shared memory (the kernel frees it too)
        if job.stop_asked:
            self._tell(("stopped", job.job_id))
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
            _killpg(pid, sig)

    def _kill_orphans(self) -> None:
        """Kill every child that is not a live process of a job, with everything below it:
        orphans of finished ranks (a DataLoader worker that outlived its rank, a daemon that
        left its group with setsid or a double fork).  Killing one can re-parent its own
        children to us (we are a subreaper): repeat until no such child is left."""
        deadline = time.monotonic() + 2.0
        while True:
            live = {pid for job in self.jobs.values() for pid in job.live} | set(self.ready)
            orphans = [pid for pid in _child_pids() if pid not in live]
            if not orphans or time.monotonic() > deadline:
                return
            for pid in orphans:
                for victim in [pid, *_descendant_pids(pid)]:
                    _killpg(victim, signal.SIGKILL)
                    _kill(victim, signal.SIGKILL)
            time.sleep(0.005)
            for pid in orphans:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _child_pids() -> list[int]:
    """Our children (the start process is single-threaded: one task)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:  # pragma: no cover - kernels without CONFIG_PROC_CHILDREN
        import psutil

        return [child.pid for child in psutil.Process().children()]


def _descendant_pids(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_cleanups(hooks) -> None:
    """Run a job's LaunchSpec.cleanups: ``("module:function", args)`` each."""
    for entry, args in hooks:
        try:
            module, _, name = entry.partition(":")
            getattr(importlib.import_module(module), name)(*args)
        except Exception:  # whatever a hook raises must not stop the start process; the kernel frees it too
            pass


# LaunchSpec.shared_fds one job may pass: they go to a ready child in one message, with its 3 pipes.
MAX_SHARED_FDS = 64
READY_MESSAGE_MAX = 1 << 20  # bytes: the largest (spec, cwd) pickle a ready child reads

# How many fds one SCM_RIGHTS message may carry (Linux: SCM_MAX_FD = 253).
FDS_PER_MESSAGE = 240


def _recv_fds(sock: socket.socket, count: int) -> list[int]:
    """``count`` fds sent by :func:`taas.launch.local.launcher.send_fds` in batches of
    FDS_PER_MESSAGE, one marker byte each."""
    fds: list[int] = []
    while len(fds) < count:
        data, batch, _, _ = socket.recv_fds(sock, 1, min(FDS_PER_MESSAGE, count - len(fds)))
        if not data:
            for fd in fds + list(batch):
                os.close(fd)
            raise EOFError("the kernel closed the channel")
        fds.extend(batch)
    return fds


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ready_child(channel: socket.socket, private: tuple[int, ...], starter: int) -> None:
    """A child forked ahead: wait for a job's process spec, then become that process."""
    try:
        os.setpgid(0, 0)
        _set_name("taas-ready")
        signal.set_wakeup_fd(-1)
        for fd in private:
            os.close(fd)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != starter:
            os._exit(0)
        message, fds, _, _ = socket.recv_fds(channel, READY_MESSAGE_MAX, 3 + MAX_SHARED_FDS)
        channel.close()
    except BaseException:  # a child forked ahead must never return into the start process's code
        os._exit(70)
    if not message:  # the start process is done with us
        os._exit(0)
    spec, cwd = pickle.loads(message)
    _child(spec, cwd, fds, (), starter)


def _ready_message_max(channel: socket.socket) -> int:
    """The largest spec a ready child can receive: one datagram (the socket's send buffer
    less its overhead), and no more than the child reads."""
    return min(channel.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32, READY_MESSAGE_MAX)


def _set_name(name: str) -> None:
    """What ps/psutil show as this process's name (comm)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def apply_storage(spec, cwd: str) -> tuple[str | None, str]:
    """Apply ``spec.storage`` to this (single-threaded, just forked) process: (a one-line
    warning or None, the mode in force: ``shared``, ``layer``, ``strict`` or ``none`` when
    even the read-only rule was refused)."""
    if spec.storage not in ("layer", "strict"):
        return None, "shared"
    from taas.workdir.storage import layer_dir, make_read_only, mount_layer

    job_dir = spec.env.get("TAAS_JOB_DIR", "")
    refused = None
    if spec.storage == "layer" and job_dir:
        refused = mount_layer(cwd, layer_dir(job_dir, spec.key))
        if refused is None:
            return None, "layer"
    warning = make_read_only(cwd, keep_writable=[job_dir] if job_dir else [])
    if refused is None:
        return warning, "strict" if warning is None else "none"
    if warning is None:
        return f"{refused}: read-only for them instead, as with --storage strict", "strict"
    return f"{refused}; {warning}", "none"


def _child(spec, cwd: str, fds: list[int], private: tuple[int, ...], starter: int) -> None:
    """Runs in the forked child: become a clean process for ``spec`` and run its entry."""
    code = 70  # EX_SOFTWARE, if setup itself fails
    try:
        os.setpgid(0, 0)
        _set_name(f"taas-{spec.key}")
        signal.set_wakeup_fd(-1)
        for fd in private:  # the kernel's channel is the starter's alone
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out, err, events = fds[:3]
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.chdir(cwd)
        warning, storage = apply_storage(spec, cwd)
        # After any namespace change (which resets it): die with the starter.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != starter:  # it died before we asked
            os._exit(code)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stdin = open(os.devnull)
        os.environ.update(spec.env)
        os.environ["TAAS_EVENTS_FD"] = str(events)
        os.environ["TAAS_SHARED_FDS"] = ",".join(str(fd) for fd in fds[3:])
        os.environ["TAAS_STORAGE"] = storage
        if warning:
            os.environ["TAAS_STORAGE_WARNING"] = warning
        module, _, function = spec.entry.partition(":")
        code = getattr(importlib.import_module(module), function)(spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child's setup or entry failed: print it, then exit (finally)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def main() -> None:
    """``python -m taas.launch.local.starter FD KERNEL_PID``: the guard, which forks the start process.

    The process the kernel starts is a small *guard* that never imports torch (so it is never
    what the OOM killer picks).  It is a child subreaper and the parent of the start process;
    when the start process dies for any reason, or the kernel dies (PR_SET_PDEATHSIG, asked
    before anything slow), the guard kills every process still below it -- ranks, and daemons
    that escaped from them and re-parented to it -- and exits.

    The other way round, the guard killed (even by SIGKILL, or by a killpg of its process
    group): the start process leads a process group of its own (set first thing after the
    fork, by both sides), so no one killpg reaches both; and its PR_SET_PDEATHSIG towards the
    guard, asked before it imports torch, is SIGTERM, on which it kills everything below it
    (it is a subreaper too: escaped daemons are its children), removes its jobs' files and
    exits (:meth:`Starter.shutdown`); while it is still importing torch SIGTERM just ends it,
    with nothing below it yet.  Not covered: the guard and the start process SIGKILLed
    separately at the same instant -- nothing is left alive to clean up; only a PID namespace
    (whose init's death kills all inside) would cover that."""
    fd, kernel = int(sys.argv[1]), int(sys.argv[2])
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # first: the kernel may die at any moment
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
    if os.getppid() != kernel:  # it died before we asked
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is the kernel's
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    guard = os.getpid()
    pid = os.fork()
    if pid:
        _setpgid(pid)  # also done by the child; whichever runs first
        os.close(fd)  # the kernel's channel is the start process's alone (EOF when it goes)
        _guard(pid, kernel)
    # A process group of our own, first: one killpg must never reach the guard and us at once.
    _setpgid(0)
    # SIGTERM, not SIGKILL: a guard killed by SIGKILL can no longer clean up after us, so we
    # must (Starter.shutdown); until the Starter handles it, SIGTERM ends us at once (still
    # blocked here, so a guard that dies now is seen when it is unblocked, or by getppid).
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD})
    if os.getppid() != guard:
        os._exit(0)
    _set_name("taas-start")
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of a job come to us first (killed at job end)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a child that needs it reports the ImportError itself, with its traceback
    # Everything imported so far lives as long as we do: keep the garbage collector of each
    # child from walking (and so copying) those pages.
    gc.freeze()
    _raise_fd_limit()
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    conn.send(("ready", os.getpid()))
    Starter(conn, sock).serve()


def _guard(starter: int, kernel: int) -> None:
    """The guard's life: wait until the start process exits or the kernel dies (SIGTERM),
    then kill everything below us and exit.  SIGTERM and SIGCHLD are blocked: sigwait.

    On SIGTERM the start process gets SIGTERM first and a moment to end its jobs and remove
    their files (it dies at once if it is still importing torch).  If the guard itself is
    killed, the start process gets the same SIGTERM from the kernel (PR_SET_PDEATHSIG, see
    :func:`main`) and cleans up alone."""
    _set_name("taas-guard")
    while True:
        if signal.sigwait({signal.SIGTERM, signal.SIGCHLD}) == signal.SIGTERM:
            break
        if _reaped(starter):  # it died (SIGKILL, OOM killer, or it ended): clean up after it
            _kill_all_children()
            os._exit(0)
    try:
        os.kill(starter, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 3.0
    while not _reaped(starter) and time.monotonic() < deadline:
        signal.sigtimedwait({signal.SIGCHLD}, max(0.0, deadline - time.monotonic()))
    _kill_all_children()
    _remove_kernel_trash(kernel)
    os._exit(0)


def _remove_kernel_trash(kernel: int) -> None:
    """Job directories the kernel renamed away to remove in the background
    (:func:`taas.launch.local.jobdir.discard`) and could not finish, because it died; and a cluster
    node's copy of the working directory its agent kept."""
    import glob
    import tempfile

    from taas.launch.local.jobdir import remove

    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"taas-trash-{kernel}-*")):
        remove(path)
    # A cluster node's copy of the notebook's working directory, when the "kernel" is a Ray
    # agent (taas.launch.ray.agent) that died without shutting down.
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"taas-workdir-{kernel}-*")):
        remove(path)


def _setpgid(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of a process group of its own."""
    try:
        os.setpgid(pid, 0)
    except OSError:  # the other side did it first, or the child is already gone
        pass


def _reaped(pid: int) -> bool:
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


def _kill_all_children() -> None:
    """SIGKILL every child (and its process group) until none is left.  We are a subreaper,
    so whatever still runs below us re-parents to us as its parents die; once we have no
    child at all, nothing is left below us."""
    import psutil

    while True:
        for child in psutil.Process().children():
            _killpg(child.pid, signal.SIGKILL)
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


def _raise_fd_limit() -> None:
    """Each process of a job holds three pipe ends, and a gloo rank a socket per peer: let
    the start process (and so every child) open as many files as the hard limit allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


if __name__ == "__main__":
    main()
