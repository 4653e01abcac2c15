"""The local launcher: every process of a job on this machine, forked by a warm start process.

The kernel side of :mod:`taas.launch.local.starter`.  One :class:`LocalLauncher` per kernel keeps one
start process alive across jobs (started in the background by ``%load_ext taas``, so the first
job is already warm, and restarted if it ever dies).  Per job, the launcher creates three pipes
per process (stdout, stderr, events), hands the write ends to the start process, and reads the
other ends itself, so output streams straight from each process to the kernel.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Iterable

from taas.errors import LaunchError
from taas.launch.local import jobdir
from taas.launch import rendezvous
from taas.launch.api import (Event, JobHandle, LaunchSpec, Launcher, OutputChunk, ProcessExit, ProcessSpec,
                             Topology, cuda_device_count)
from taas.launch.local.starter import FDS_PER_MESSAGE, MAX_SHARED_FDS
from taas.shield import deferred_interrupt

_STREAMS = ("stdout", "stderr", "events")
_READY_TIMEOUT = 120.0  # a cold `import torch` on a busy 2-core machine can take many seconds
# Open files the kernel needs per process of a job while it runs: three pipe ends, and the
# process's connection to the kernel-hosted rendezvous store.
_FDS_PER_PROCESS = 4
_FD_MARGIN = 64  # what the kernel itself may open meanwhile

# The start process's guard dies with the *thread* that started it (PR_SET_PDEATHSIG follows
# the parent thread): start it from one thread that lives as long as the kernel, never from a
# cell's thread that may end.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="taas-spawner")


class LocalLauncher(Launcher):
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._conn: Connection | None = None
        self._ready = False
        self.starter_pid: int | None = None

    # -- the start process ---------------------------------------------------------------
    def warm(self) -> None:
        """Start the start process in the background if it is not running."""
        if self._proc is not None and self._proc.poll() is None:
            return
        jobdir.sweep()  # what a kernel that died left to remove
        self._close_starter()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            with deferred_interrupt():  # never a started guard we do not know of
                self._proc = _spawner.submit(
                    subprocess.Popen,
                    [sys.executable, "-m", "taas.launch.local.starter", str(theirs.fileno()),
                     str(os.getpid())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # the kernel's interrupt (SIGINT to its group) is its own
                ).result()
        finally:
            theirs.close()
        self._sock = ours
        self._conn = Connection(os.dup(ours.fileno()))
        self._ready = False

    def _ensure_ready(self) -> Connection:
        self.warm()
        assert self._conn is not None and self._proc is not None
        if not self._ready:
            if not self._conn.poll(_READY_TIMEOUT):
                self._close_starter()
                raise LaunchError("the taas start process did not come up in time; run the cell again")
            try:
                with deferred_interrupt():
                    tag, pid = self._conn.recv()
            except EOFError:
                code = self._proc.wait()
                self._close_starter()
                raise LaunchError(
                    f"the taas start process exited during start-up (code {code}); "
                    "see the kernel's log, check that torch imports in this environment"
                ) from None
            assert tag == "ready"
            self.starter_pid = pid
            self._ready = True
        return self._conn

    def _close_starter(self) -> None:
        for closable in (self._conn, self._sock):
            if closable is not None:
                closable.close()
        self._conn = self._sock = None
        if self._proc is not None:
            _end_guard(self._proc)
        self._proc = None
        self._ready = False

    def shutdown(self) -> None:
        """Close the channel: the start process ends every job and exits."""
        jobdir.flush()
        proc = self._proc
        for closable in (self._conn, self._sock):
            if closable is not None:
                closable.close()
        self._conn = self._sock = None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _end_guard(proc)
        self._proc = None
        self._ready = False

    def topology(self, world: int) -> Topology:
        """One machine, the kernel's: every rank on node 0, shared memory reaches them all."""
        return Topology(rank_nodes=(0,) * world)

    # -- jobs ----------------------------------------------------------------------------
    def check(self, processes: int, device: str = "cpu", ranks: int | None = None) -> None:
        """Raise LaunchError (one line) if a job of ``processes`` processes cannot start here."""
        check_fd_limit(processes)

    def start(self, spec: LaunchSpec) -> "LocalJob":
        if len(spec.shared_fds) > MAX_SHARED_FDS:
            raise LaunchError(f"a job can pass at most {MAX_SHARED_FDS} shared files to its processes, "
                              f"not {len(spec.shared_fds)}")
        if spec.device == "cuda":
            check_gpus(spec.world_size)
        check_fd_limit(len(spec.processes))
        try:
            conn = self._ensure_ready()
        except OSError as exc:
            raise LaunchError(f"could not start the job: {exc}") from None
        # Each attempt of a job is a job of its own for the start process (late messages
        # about attempt 1 must not reach attempt 2).
        attempt = spec.attempt
        job_dir = jobdir.create(attempt)
        store = None
        readers: dict[int, tuple[str, str]] = {}
        try:
            jobdir.write_files(job_dir, spec.files)
            if spec.world_size and not spec.placed:
                store, port = rendezvous.agent_store(spec.world_size)
            else:  # no rank, or the rendezvous is someone else's (LaunchSpec.placed)
                store, port = None, 0
            processes = _place(spec, job_dir, port)
            keys = [(proc.key, stream) for proc in processes for stream in _STREAMS]
            # No interrupt between the request and its fds: the channel would be out of step.
            with deferred_interrupt():
                conn.send(("spawn", attempt, spec.cwd, job_dir, processes,
                           len(spec.shared_fds), tuple(spec.cleanups)))
                for start in range(0, len(keys), FDS_PER_MESSAGE):
                    batch = keys[start : start + FDS_PER_MESSAGE]
                    writers = []
                    try:
                        for key in batch:
                            r, w = os.pipe()
                            readers[r] = key
                            writers.append(w)
                        socket.send_fds(self._sock, [b"f"], writers)
                    finally:
                        for w in writers:
                            os.close(w)
                shared = list(spec.shared_fds)
                for start in range(0, len(shared), FDS_PER_MESSAGE):
                    socket.send_fds(self._sock, [b"f"], shared[start : start + FDS_PER_MESSAGE])
        except OSError as exc:
            for r in readers:
                os.close(r)
            jobdir.remove(job_dir)
            store = None  # its listening port closes now, not when a kept traceback goes
            self._close_starter()  # it waits for fds that will not come: start afresh
            raise LaunchError(f"could not start the job ({exc}); run the cell again") from None
        except BaseException:  # LaunchError (no room) or Ctrl-C before the request went out
            for r in readers:
                os.close(r)
            jobdir.remove(job_dir)
            store = None  # its listening port closes now, not when a kept traceback goes
            raise
        job = LocalJob(self, attempt, readers, job_dir, store)
        store = None  # the job owns it
        try:
            job._await_spawned()
        except BaseException:  # interrupted or failed while starting: leave nothing running
            if self._conn is not None:
                try:
                    self._conn.send(("stop", attempt, 0.0))
                except OSError:
                    pass
            job.close()
            raise
        return job


def _place(spec: LaunchSpec, job_dir: str, port: int) -> list[ProcessSpec]:
    """Every process on this machine: a rank gets torchrun's variables for one node (local
    rank = rank), a scratch directory, and every socket on loopback.  A ``placed`` spec keeps
    the rendezvous its ranks carry and gets only the job directory's variables."""
    world = spec.world_size
    places = {p.rank: p for p in rendezvous.one_node(world)}
    common = {"TAAS_JOB_DIR": job_dir}
    if spec.placed:
        return [dataclasses.replace(proc, env=dict(
            proc.env, **common, **({} if proc.rank is None else
                                   {"TAAS_SCRATCH": jobdir.scratch(job_dir, proc.rank)})))
            for proc in spec.processes]
    lo = rendezvous.loopback_ifname()
    if lo:  # one machine: every socket on loopback, gloo's and NCCL's bootstrap too
        common["GLOO_SOCKET_IFNAME"] = lo
        common["NCCL_SOCKET_IFNAME"] = lo
    out = []
    for proc in spec.processes:
        env = dict(proc.env, **common)
        if proc.rank is not None:
            env.update(rendezvous.torchrun_env(places[proc.rank], world, "127.0.0.1", port, spec.job_id,
                                               spec.restart, spec.max_restarts))
            env["TAAS_SCRATCH"] = jobdir.scratch(job_dir, proc.rank)
        out.append(dataclasses.replace(proc, env=env))
    return out


def check_gpus(ranks: int) -> None:
    """One rank per GPU on this machine."""
    count = cuda_device_count()
    if ranks > count:
        raise LaunchError(f"--gpus {ranks} asks for more GPUs than this machine has ({count}); "
                          "for more GPUs, run it on a Ray cluster (%taas cluster ADDRESS, or --cluster ADDRESS)")


def _fds_needed(processes: int) -> int:
    """Extra open files the kernel holds for a job of ``processes`` processes, at the peak:
    while starting, every read end plus one batch of write ends; while running, the read ends
    and each process's store connection."""
    streams = len(_STREAMS) * processes
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


def _end_guard(proc: subprocess.Popen) -> None:
    """End the start process's guard: SIGTERM makes it kill everything below it first (and
    if it must be SIGKILLed, the start process's parent-death SIGTERM does that instead)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


class LocalJob(JobHandle):
    def __init__(self, launcher: LocalLauncher, job_id: str, readers: dict[int, tuple[str, str]],
                 job_dir: str, store=None):
        self._launcher = launcher
        self.job_dir = job_dir  # see taas.launch.local.jobdir
        self._store = store  # the attempt's rendezvous store; its port closes with it
        self._conn = launcher._conn
        self.job_id = job_id
        self._readers = readers
        self._selector = selectors.DefaultSelector()
        for fd in readers:
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ)
        self._selector.register(self._conn.fileno(), selectors.EVENT_READ)
        self._pids: dict[str, int] = {}
        self._exited: set[str] = set()
        self._pending: list[Event] = []
        self._stopped = False
        self._starter_lost = False

    @property
    def pids(self) -> dict[str, int]:
        return dict(self._pids)

    @property
    def keys(self) -> list[str]:
        return list(self._pids)

    def fetch(self, key: str, name: str) -> bytes | None:
        return jobdir.read(self.job_dir, name) if self.job_dir else None

    def request_stacks(self, keys) -> list[str]:
        from taas.launch.process import stacks

        return stacks.request(self.job_dir, keys) if self.job_dir else []

    def layers(self) -> list[tuple[str, str]]:
        return jobdir.layers(self.job_dir) if self.job_dir else []

    @property
    def running(self) -> bool:
        return len(self._exited) < len(self._pids)

    @property
    def finished(self) -> bool:
        """Every process exited and all its output was read: :meth:`events` has nothing more."""
        return not self._readers and not self.running

    def _await_spawned(self) -> None:
        while True:
            message = self._recv_control(timeout=30)
            if message is None:
                raise LaunchError("the taas start process did not answer; run the cell again")
            if message[0] == "spawned" and message[1] == self.job_id:
                self._pids = message[2]
                return
            if message[0] == "error" and message[1] == self.job_id:
                self.close()
                raise LaunchError(message[2])

    def _recv_control(self, timeout: float):
        try:
            if self._conn.poll(timeout):
                with deferred_interrupt():  # never half a message
                    return self._conn.recv()
        except (EOFError, OSError):
            self._lose_starter()
        return None

    def _lose_starter(self) -> None:
        """The start process is gone (or we killed it): so are its children (PDEATHSIG)."""
        self._starter_lost = True
        for key, pid in self._pids.items():
            if key not in self._exited:
                self._exited.add(key)
                self._pending.append(ProcessExit(key, pid, -9))
        if self._conn is not None and self._conn.fileno() in self._selector.get_map():
            self._selector.unregister(self._conn.fileno())
        self._launcher._close_starter()

    def _handle_control(self, message) -> None:
        if message[1] != self.job_id:
            return  # a late message about an earlier job
        if message[0] == "exit":
            _, _, key, pid, code = message
            self._exited.add(key)
            self._pending.append(ProcessExit(key, pid, code))
        elif message[0] == "stopped":
            self._stopped = True

    def events(self, timeout: float) -> Iterable[Event]:
        if not self._pending:
            self._poll(timeout)
        out, self._pending = self._pending, []
        return out

    def _poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output or control messages; queue what arrives."""
        if self._readers or self.running or not self._stopped:
            for sel_key, _ in self._selector.select(timeout):
                fd = sel_key.fd
                if self._conn is not None and not self._starter_lost and fd == self._conn.fileno():
                    while not self._starter_lost and self._conn.poll(0):
                        message = self._recv_control(0)
                        if message is not None:
                            self._handle_control(message)
                    continue
                self._read(fd)

    def _read(self, fd: int) -> None:
        key, stream = self._readers[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self._pending.append(OutputChunk(key, stream, data))
        else:
            self._selector.unregister(fd)
            os.close(fd)
            del self._readers[fd]

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped or self._starter_lost or not self._pids:
            return
        if self.running:
            try:
                with deferred_interrupt():
                    self._conn.send(("stop", self.job_id, grace))
            except OSError:
                self._recv_control(0)
                return
            deadline = time.monotonic() + grace + 5
            while not self._stopped and not self._starter_lost:
                if time.monotonic() > deadline:
                    # Never leave a job behind: kill the start process, its children die too.
                    self._lose_starter()
                    break
                self._poll(0.05)
        self._stopped = True

    def drain(self, timeout: float = 2.0) -> list[Event]:
        """Read what is left in the pipes after every process exited."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout
        while self._readers and time.monotonic() < deadline:
            out.extend(self.events(0.05))
        return out

    def close(self) -> None:
        self.stop()
        for fd in list(self._readers):
            self._selector.unregister(fd)
            os.close(fd)
        self._readers.clear()
        self._selector.close()
        self._store = None  # closes its listening port
        if self.job_dir:
            jobdir.discard(self.job_dir)
            self.job_dir = ""
