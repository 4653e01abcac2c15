"""A second launcher, deliberately unlike the local one, to prove the launcher contract.

:mod:`taas.launch.local.launcher` forks every process from one warm start process that has torch
imported, and all of a job's processes share one job directory.  This launcher starts each
process with :mod:`subprocess` (a fresh interpreter: ``python -m tests.support.private_launcher DIR``)
and gives each one its own private temporary root: the job's files are copied into every
process's root, and what a process leaves there (report, fault dump, results, layer) is read
back from that root only.  Nothing is shared through files; the session and supervisor must not
notice.  Selected with ``TAAS_LAUNCHER=tests.support.private_launcher:PrivateLauncher``.

It keeps ranks (``--keep``) through the contract's kept-ranks calls alone: each rank makes its
cell FIFO (:mod:`taas.launch.process.cells`) in its own root, so ``next_cell`` writes the cell's
files into every root and sends the cell down each rank's FIFO there; whether a process is gone
is its ``Popen``'s to say; ``interrupt`` is ``Popen.send_signal``; memory is asked of psutil.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from taas.errors import KeptRanksGone, LaunchError
from taas.launch import rendezvous
from taas.launch.api import (RESULT, JobHandle, Launcher, LaunchSpec, OutputChunk, ProcessExit, Topology,
                             error_name, run_cleanups)
from taas.launch.process import cells
from tests.support.paths import with_repo_on_path

_STREAMS = ("stdout", "stderr", "events")


class PrivateLauncher(Launcher):
    keeps_ranks = True  # PrivateJob's kept-ranks calls: a FIFO per rank in its own root

    def __init__(self):
        self.jobs: list[PrivateJob] = []

    def start(self, spec: LaunchSpec) -> "PrivateJob":
        store, port = rendezvous.agent_store(spec.world_size) if spec.world_size else (None, 0)
        job = PrivateJob(spec, store)
        try:
            for proc in spec.processes:
                job.spawn(proc, port)
            job.watch()
        except BaseException:  # a failed start leaves nothing
            job.close()
            raise
        self.jobs = [j for j in self.jobs if not j.closed] + [job]
        return job

    def topology(self, world: int) -> Topology:
        return Topology(rank_nodes=(0,) * world)  # one machine here too

    def shutdown(self) -> None:
        for job in self.jobs:
            job.close()
        self.jobs = []


class PrivateJob(JobHandle):
    def __init__(self, spec: LaunchSpec, store):
        self.spec = spec
        self.store = store
        self.roots: dict[str, str] = {}  # key -> the process's private root
        self.procs: dict[str, subprocess.Popen] = {}
        self.readers: dict[int, tuple[str, str]] = {}
        self.selector = selectors.DefaultSelector()
        self.exited: set[str] = set()
        self.stopped = False
        self.closed = False
        self.watcher: subprocess.Popen | None = None
        # What the last cell put in (or had rank 0 leave in) every root: the next cell removes it.
        self.cell_files: set[str] = set(spec.files) | {RESULT}

    # -- starting ------------------------------------------------------------------------
    def spawn(self, proc, port: int) -> None:
        spec = self.spec
        root = self.roots[proc.key] = tempfile.mkdtemp(prefix=f"taas-private-{proc.key}-")
        _put(root, spec.files)
        env = dict(os.environ, **proc.env, TAAS_JOB_DIR=root, TMPDIR=root,
                   GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        if proc.rank is not None:
            place = rendezvous.Placement(proc.rank, proc.rank, spec.world_size)
            env.update(rendezvous.torchrun_env(place, spec.world_size, "127.0.0.1", port, spec.job_id,
                                               spec.restart, spec.max_restarts))
            env["TAAS_SCRATCH"] = os.path.join(root, "scratch")
            os.makedirs(env["TAAS_SCRATCH"])
        with open(os.path.join(root, "spec.pkl"), "wb") as f:
            pickle.dump((dataclasses.replace(proc, env=env), spec.cwd), f)
        events_r, events_w = os.pipe()
        shared = list(spec.shared_fds)
        env["TAAS_EVENTS_FD"] = str(events_w)
        env["TAAS_SHARED_FDS"] = ",".join(map(str, shared))
        with_repo_on_path(env)
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "tests.support.private_launcher", root, str(os.getpid())],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                pass_fds=[events_w, *shared], env=env, cwd=spec.cwd, start_new_session=True)
        except OSError as exc:
            os.close(events_r)
            raise LaunchError(f"could not start {proc.key}: {exc}") from None
        finally:
            os.close(events_w)
        self.procs[proc.key] = popen
        for stream, fd in (("stdout", popen.stdout.fileno()), ("stderr", popen.stderr.fileno()),
                           ("events", events_r)):
            os.set_blocking(fd, False)
            self.readers[fd] = (proc.key, stream)
            self.selector.register(fd, selectors.EVENT_READ)

    def watch(self) -> None:
        """The contract's "when the kernel died": a watcher of our own (not the local
        launcher's guard) that outlives the kernel.  It waits for its stdin to end: a line
        from :meth:`close` first means all is done; no line means the kernel died, and then it
        kills the processes' groups, runs the job's cleanups and removes the roots."""
        what = pickle.dumps(([p.pid for p in self.procs.values()], list(self.roots.values()),
                             list(self.spec.cleanups)))
        env = with_repo_on_path(dict(os.environ))
        self.watcher = subprocess.Popen(
            [sys.executable, "-m", "tests.support.private_launcher", "--watch", what.hex()],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True)

    # -- the contract --------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return list(self.procs)

    def _exits(self) -> list[ProcessExit]:
        out = []
        for key, popen in self.procs.items():
            if key not in self.exited and popen.poll() is not None:
                self.exited.add(key)
                _killpg(popen.pid, signal.SIGKILL)  # whatever it started goes with it
                out.append(ProcessExit(key, popen.pid, popen.returncode))
        return out

    def events(self, timeout: float):
        out = []
        if self.readers:
            for sel_key, _ in self.selector.select(timeout):
                out.extend(self._read(sel_key.fd))
        elif len(self.exited) < len(self.procs):
            time.sleep(min(timeout, 0.02))
        return out + self._exits()

    def _read(self, fd: int):
        key, stream = self.readers[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return []
        if data:
            return [OutputChunk(key, stream, data)]
        self.selector.unregister(fd)
        if stream == "events":
            os.close(fd)
        del self.readers[fd]
        return []

    def drain(self, timeout: float = 2.0):
        out, deadline = [], time.monotonic() + timeout
        while self.readers and time.monotonic() < deadline:
            out.extend(self.events(0.05))
        return out + self._exits()

    def stop(self, grace: float = 1.0) -> None:
        self.stopped = True
        live = [p for k, p in self.procs.items() if p.poll() is None]
        for popen in live:
            _killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.01)
        for popen in self.procs.values():
            _killpg(popen.pid, signal.SIGKILL)
            popen.wait()

    def fetch(self, key: str, name: str) -> bytes | None:
        root = self.roots.get(key)
        try:
            with open(os.path.join(root, name), "rb") as f:
                return f.read()
        except (OSError, TypeError):
            return None

    def request_stacks(self, keys) -> list[str]:
        from taas.launch.process import stacks

        return [k for k in keys if k in self.roots and stacks.request(self.roots[k], [k])]

    def answer(self, key: str, reply) -> bool:
        from taas.launch.process import stdin

        return key in self.roots and stdin.answer(self.roots[key], key, reply)

    def layers(self) -> list[tuple[str, str]]:
        from taas.launch.local.jobdir import layers  # each private root has the job directory's layout

        return [layer for root in self.roots.values() for layer in layers(root)]

    # -- kept ranks (the contract's optional part) ---------------------------------------------
    def lost(self) -> str | None:
        if self.stopped:
            return "the job's processes were stopped"
        for key, popen in self.procs.items():
            code = popen.poll()  # not reported here: the next events() still has the exit
            if code is not None:
                return f"{key} ended ({_ending(code)})"
        # Ending but not reaped yet (its main thread gone): as the local launcher does.
        return cells.ending({p.key: self.procs[p.key].pid for p in self.spec.processes
                             if p.rank is not None and p.key in self.procs})

    def next_cell(self, files: dict[str, bytes], payload: str, result: str) -> None:
        why = self.lost()
        if why is not None:
            raise KeptRanksGone(why)
        ranks = [proc.key for proc in self.spec.processes if proc.rank is not None]
        for key in ranks:  # as the local launcher does: a rank gone (its exit maybe not reported
            exc = cells.unreachable(self.roots[key], [key])  # yet) before anything is sent
            if exc is not None:
                raise KeptRanksGone(f"{key} cannot be reached ({exc.strerror})")
        try:
            for key in ranks:  # every root first: no rank gets a cell whose files another lacks
                root = self.roots[key]
                for name in self.cell_files | {error_name(key)}:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(root, name))
                _put(root, files)
        except OSError as exc:
            raise LaunchError(f"could not write the cell's files for the kept ranks: {exc.strerror}") from None
        self.cell_files = set(files) | {result}
        for key in ranks:
            try:
                cells.send(self.roots[key], key, cells.NextCell(payload, result))
            except OSError as exc:  # its FIFO has no reader: the rank ended this instant
                raise LaunchError(f"the kept ranks are gone: {key} cannot be reached ({exc.strerror})") from None

    def interrupt(self, keys) -> list[str]:
        signalled = []
        for key in keys:
            popen = self.procs.get(key)
            if popen is not None and popen.poll() is None:
                popen.send_signal(signal.SIGINT)  # the rank is the interpreter itself: its main thread
                signalled.append(key)
        return signalled

    def running_pids(self) -> dict[str, int]:
        return {key: popen.pid for key, popen in self.procs.items() if popen.poll() is None}

    def memory(self) -> dict[str, int]:
        import psutil

        rss = {}
        for key, pid in self.running_pids().items():
            with contextlib.suppress(psutil.Error):  # ended meanwhile
                rss[key] = psutil.Process(pid).memory_info().rss
        return rss

    def fileno(self) -> int | None:
        """The selector's own descriptor (epoll): readable once a pipe of this job is.  Exits are
        seen by polling each Popen, which :meth:`events` does however it was woken."""
        return None if self.closed else self.selector.fileno()

    def close(self) -> None:
        if self.closed:
            return
        self.stop(0.5)
        for fd, (_, stream) in list(self.readers.items()):
            self.selector.unregister(fd)
            if stream == "events":
                os.close(fd)
        self.readers.clear()
        for popen in self.procs.values():
            for pipe in (popen.stdout, popen.stderr):
                pipe.close()
        self.selector.close()
        self.store = None
        for root in self.roots.values():
            from taas.launch.local.jobdir import remove

            remove(root)
        run_cleanups(self.spec.cleanups)  # the caller frees them too; hooks are idempotent
        if self.watcher is not None:  # all is done: the watcher leaves without doing anything
            try:
                self.watcher.communicate(b"closed\n", timeout=10)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait()
        self.closed = True


def _put(root: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)


def _ending(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(what: str) -> int:
    """The watcher's side (:meth:`PrivateJob.watch`)."""
    pgids, roots, cleanups = pickle.loads(bytes.fromhex(what))
    if sys.stdin.buffer.readline():  # the job closed as usual
        return 0
    for pgid in pgids:  # the kernel died: end what it left, free what the job held
        _killpg(pgid, signal.SIGKILL)
    import shutil

    run_cleanups(cleanups)
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _run(root: str, parent: int) -> int:
    """The process side: a fresh interpreter becomes the process described in ``root``."""
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the kernel
    if os.getppid() != parent:
        return 70
    with open(os.path.join(root, "spec.pkl"), "rb") as f:
        spec, cwd = pickle.load(f)
    # PR_SET_NAME: `ps` (and the tests, which find ranks by name) tell this interpreter's role.
    libc.prctl(15, ctypes.c_char_p(f"taas-{spec.key}".encode()[:15]), 0, 0, 0)
    from taas.launch.local.child import apply_storage

    os.chdir(cwd)
    warning, storage = apply_storage(spec, cwd)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # a new namespace reset it
    if os.getppid() != parent:
        return 70
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ["TAAS_STORAGE"] = storage
    if warning:
        os.environ["TAAS_STORAGE_WARNING"] = warning
    signal.signal(signal.SIGINT, signal.default_int_handler)
    module, _, function = spec.entry.partition(":")
    import importlib

    return getattr(importlib.import_module(module), function)(spec)


if __name__ == "__main__":
    code = _watch(sys.argv[2]) if sys.argv[1] == "--watch" else _run(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
