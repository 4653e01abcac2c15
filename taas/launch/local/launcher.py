"""The local launcher: every process of a job on this machine, forked by a warm start process.

The kernel side of :mod:`taas.launch.local.starter`.  One :class:`LocalLauncher` per kernel keeps one
start process alive across jobs (started in the background by ``%load_ext taas``, so the first
job is already warm, and restarted if it ever dies).  Per job, the launcher creates three pipes
per process (stdout, stderr, events), hands the write ends to the start process with a
:class:`~taas.launch.local.protocol.Spawn`, and gives the read ends to the job
(:class:`~taas.launch.local.job.LocalJob`), so output streams straight from each process to the
kernel.  What fits on this machine is checked first (:mod:`taas.launch.local.limits`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from taas.errors import LaunchError
from taas.launch import rendezvous
from taas.launch.api import Launcher, LaunchSpec, ProcessSpec, Topology
from taas.launch.local import forkstart, jobdir, protocol

# LocalJob and the checks are re-exported: callers import them from here.
from taas.launch.local.job import LocalJob
from taas.launch.local.limits import check_fd_limit, check_gpus, check_shared_fds
from taas.launch.local.mailboxes import Mailboxes
from taas.launch.local.protocol import FDS_PER_MESSAGE, STREAMS, Ready, Spawn, Stop
from taas.shield import deferred_interrupt

__all__ = ["LocalJob", "LocalLauncher", "check_fd_limit", "check_gpus"]

_READY_TIMEOUT = 120.0  # a cold `import torch` on a busy 2-core machine can take many seconds

# The start process's guard dies with the *thread* that started it (PR_SET_PDEATHSIG follows
# the parent thread): start it from one thread that lives as long as the kernel, never from a
# cell's thread that may end.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="taas-spawner")


class LocalLauncher(Launcher):
    keeps_ranks = True  # LocalJob implements next_cell and interrupt (--keep)

    def __init__(self) -> None:
        self._proc: subprocess.Popen | forkstart.ForkedGuard | None = None
        self._sock: socket.socket | None = None
        self._conn: Connection | None = None
        self._ready = False
        self.starter_pid: int | None = None
        # The start process's answers about each live job (several live at once with kept
        # ranks and a cell's loader job): taas.launch.local.mailboxes.
        self._mail = Mailboxes()
        # A job host forked warm (taas.host.zygote) forks its start process too, once.
        self._fork_start = forkstart.asked()

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
                if self._fork_start and forkstart.may_fork():  # a warm job host: torch already imported
                    self._fork_start = False  # a later start process (this one died): a fresh one
                    self._proc = forkstart.fork_guard(theirs.fileno(), package_root)
                else:
                    self._proc = _spawner.submit(
                        subprocess.Popen,
                        [sys.executable, "-m", "taas.launch.local.starter", str(theirs.fileno()),
                         str(os.getpid())],
                        pass_fds=[theirs.fileno()],
                        stdin=subprocess.DEVNULL,
                        env=env,
                        start_new_session=True,  # the kernel's interrupt (SIGINT to its group) is its own
                    ).result()
                self._sock = ours  # with the process: a Ctrl-C never leaves one we cannot reach
                self._conn = Connection(os.dup(ours.fileno()))
                self._ready = False
        finally:
            theirs.close()

    def _ensure_ready(self) -> Connection:
        self.warm()
        assert self._conn is not None and self._proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT
        while not self._ready:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._close_starter()
                raise LaunchError("the taas start process did not come up in time; run the cell again")
            try:
                with deferred_interrupt():
                    message = protocol.receive(self._conn)
            except EOFError:
                code = self._proc.wait()
                self._close_starter()
                raise LaunchError(
                    f"the taas start process exited during start-up (code {code}); "
                    "see the kernel's log, check that torch imports in this environment"
                ) from None
            if isinstance(message, Ready):  # anything else before it: logged (decode) or stale
                self.starter_pid = message.pid
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

    def start(self, spec: LaunchSpec) -> LocalJob:
        check_shared_fds(len(spec.shared_fds))
        if spec.device == "cuda":
            check_gpus(spec.world_size)
        check_fd_limit(len(spec.processes))
        try:
            conn = self._ensure_ready()
        except OSError as exc:
            raise LaunchError(f"could not start the job: {exc}") from None
        sock = self._sock
        assert sock is not None  # set with the connection by warm()
        # Each attempt of a job is a job of its own for the start process (late messages
        # about attempt 1 must not reach attempt 2).
        attempt = spec.attempt
        job_dir = jobdir.create(attempt)
        store = None
        readers: dict[int, tuple[str, str]] = {}
        job: LocalJob | None = None
        interrupted: BaseException | None = None
        try:
            jobdir.write_files(job_dir, spec.files)
            if spec.world_size and not spec.placed:
                store, port = rendezvous.agent_store(spec.world_size)
            else:  # no rank, or the rendezvous is someone else's (LaunchSpec.placed)
                store, port = None, 0
            request = Spawn(attempt, spec.cwd, job_dir, tuple(_place(spec, job_dir, port)),
                            len(spec.shared_fds), tuple(spec.cleanups))
            # A Ctrl-C meanwhile waits until a LocalJob owns what the request starts: once the
            # request went out, the start process makes the processes, and only a Stop ends them.
            with deferred_interrupt():
                self._send_spawn(conn, sock, request, list(spec.shared_fds), readers)
                job = LocalJob(conn, self._close_starter, attempt, readers, job_dir, store, self._mail)
                store = None  # the job owns it
        except OSError as exc:
            for r in readers:
                os.close(r)
            jobdir.remove(job_dir)
            store = None  # its listening port closes now, not when a kept traceback goes
            self._close_starter()  # it waits for fds that will not come: start afresh
            raise LaunchError(f"could not start the job ({exc}); run the cell again") from None
        except BaseException as exc:
            if job is None:  # LaunchError (no room), or a Ctrl-C before the request went out
                for r in readers:
                    os.close(r)
                jobdir.remove(job_dir)
                store = None  # its listening port closes now, not when a kept traceback goes
                raise
            interrupted = exc  # the Ctrl-C held while it went out: its processes are stopped below
        assert job is not None
        try:
            if interrupted is not None:
                raise interrupted
            job.await_spawned()
        except BaseException:  # interrupted or failed while starting: leave nothing running
            if self._conn is not None:
                try:
                    protocol.send(self._conn, Stop(attempt, 0.0))
                except OSError:
                    pass
            job.close()
            raise
        return job

    @staticmethod
    def _send_spawn(conn: Connection, sock: socket.socket, request: Spawn, shared: list[int],
                    readers: dict[int, tuple[str, str]]) -> None:
        """Send ``request`` and then its fds: a pipe per stream of each process, created one
        batch at a time (so the kernel holds at most one batch of write ends, see
        limits.check_fd_limit); each read end goes into ``readers`` as it is made, so the
        caller closes them whatever fails."""
        keys = [(proc.key, stream) for proc in request.processes for stream in STREAMS]
        # No interrupt between the request and its fds: the channel would be out of step.
        with deferred_interrupt():
            protocol.send(conn, request)
            for start in range(0, len(keys), FDS_PER_MESSAGE):
                writers = []
                try:
                    for key in keys[start : start + FDS_PER_MESSAGE]:
                        r, w = os.pipe()
                        readers[r] = key
                        writers.append(w)
                    protocol.send_fds(sock, writers)
                finally:
                    for w in writers:
                        os.close(w)
            protocol.send_fds(sock, shared)


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


def _end_guard(proc: subprocess.Popen | forkstart.ForkedGuard) -> None:
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
