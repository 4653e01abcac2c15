"""One node's agent for the Ray launcher: the local launcher, kept warm, driven by actor calls.

:class:`NodeAgent` is a plain class; :mod:`taas.launch.ray.cluster` makes it a Ray actor, one
per node (pinned with ``NodeAffinitySchedulingStrategy``, ``num_cpus=0``, owned by the
kernel's Ray connection, so it dies with it).  It wraps a :class:`~taas.launch.local.launcher.LocalLauncher`:
its warm start process, fork-ahead, pipes, process groups, parent-death signals and subreaper
work on every node as on one machine.  Ranks are children of that start process, never Ray
workers; the start process's guard has the agent as its "kernel", so a dead agent takes its
node's processes along.

Calls come from the kernel concurrently (a threaded actor): one long-poll :meth:`events` at a
time per job, and :meth:`stop`, :meth:`fetch`, :meth:`request_stacks` meanwhile.

An agent runs one job's share at a time, except beside kept ranks (``--keep``): a kept cell
that reads registered loaders runs its loader job (on a GPU node: the data relay) next to the
kept job, both children of the node's start process.  So the agent holds its jobs by attempt
id, and the per-job calls (:meth:`events`, :meth:`stop`, :meth:`layers`, :meth:`close`) name
theirs (None: the one started last); a process's calls (:meth:`fetch`, :meth:`request_stacks`,
:meth:`interrupt`) go to the job that has it, the kept-ranks calls to the kept job.  A start
replaces an earlier job of its kind (with ranks, or without) that the kernel did not close.

The local job handle is not thread-safe, so :meth:`events` reads it in 50 ms slices under a
lock, and a stop waits at most one slice.

Node 0's agent also hosts the attempt's rendezvous store (:meth:`host_store`), on its node's
address, port 0: torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` arrangement across nodes.

A node that does not share the kernel's filesystem keeps a copy of the notebook's working
directory (:mod:`taas.workdir.sync`): ``<tmp>/taas-workdir-<agent pid>-XXXX/<name>``,
updated before each job (:meth:`workdir_need`, :meth:`workdir_update`), read back after it
(:meth:`workdir_changes`, :meth:`layer_entries`), removed at :meth:`shutdown` -- and by a
detached watcher when the agent dies without one (:mod:`taas.launch.ray.node_watch`, which also runs
the clean-up hooks of the job the agent ran: Ray kills an ended actor's children with it).

Nothing here imports Ray: the class is tested as it is, on one machine.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import threading
import time
from collections.abc import Callable

from taas.launch import rendezvous
from taas.launch.api import LaunchSpec
from taas.launch.local import jobdir
from taas.launch.local.launcher import LocalLauncher
from taas.launch.ray import node_watch
from taas.workdir import sync as workdir_sync
from taas.ready import CLOSED, wait_readable

_SLICE = 0.05  # at most this long between two reads of a job's pipes in a long poll
WATCH_EVERY = 0.5  # seconds between two looks at whether the kernel is still there
# Seconds without any call from the kernel, while a job runs, after which it counts as gone when
# nothing better says so (see NodeAgent._watch_kernel): long, because a busy kernel is slow.
SILENT = 120.0

log = logging.getLogger(__name__)


def visible_cuda() -> int:
    """CUDA devices a process started here would see, without importing torch or touching the
    driver: NVIDIA device nodes, limited by ``CUDA_VISIBLE_DEVICES`` (a node that only
    advertises GPUs to Ray -- a simulated cluster -- has none)."""
    count = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def _import_torch() -> None:
    """Warm the agent's own ``import torch`` (for the rendezvous store) in the background."""
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # broad: a broken torch shows up, with its message, when the store starts
        pass


class NodeAgent:
    def __init__(self, node_id: str, ip: str, kernel_gone: Callable[[], bool | None] | None = None):
        # Every process taas starts on this node (the start process and all it forks) says
        # which Ray node it runs on.
        os.environ["TAAS_NODE_ID"] = node_id
        self.node_id = node_id
        self.ip = ip
        self._ifname = rendezvous.ifname_for(ip)
        self._launcher = LocalLauncher()
        self._launcher.warm()  # the start process imports torch while the kernel gets ready
        self._lock = threading.Lock()
        # attempt -> the local job handle of this node's share, in start order
        self._jobs: dict[str, object] = {}
        self._ranked: set[str] = set()  # attempts whose share here has ranks
        self._kept: str | None = None  # the attempt whose ranks live between cells (--keep)
        self._specs: dict[str, tuple] = {}  # attempt -> its clean-up hooks (LaunchSpec.cleanups)
        self._stores: dict[str, object] = {}
        self._copies: dict[str, tuple[str, dict]] = {}  # kernel's cwd -> (copy here, its manifest)
        self._polled = time.monotonic()  # the kernel's last call
        self._kernel_gone = kernel_gone or (lambda: None)
        threading.Thread(target=_import_torch, name="taas-agent-torch", daemon=True).start()
        threading.Thread(target=self._watch_kernel, name="taas-agent-watchdog", daemon=True).start()
        node_watch.start(os.getpid())  # cleans up after us if Ray ends us (taas.launch.ray.node_watch)

    def _watch_kernel(self) -> None:
        """While a job runs here, end it as soon as the kernel is gone (killed, or its node
        lost), rather than when Ray gets round to ending this actor, which can take many
        seconds on a busy cluster.

        Gone is an event, not a silence: ``kernel_gone()`` (given by the cluster: whether
        the kernel's Ray driver has ended, which Ray records as soon as the driver's
        connection closes) says so.  A slow kernel is never taken for a dead one: only when
        ``kernel_gone`` cannot tell (None) does a silence of SILENT s count."""
        while True:
            time.sleep(WATCH_EVERY)
            with self._lock:
                jobs = dict(self._jobs)
                if all(job.finished for job in jobs.values()):
                    continue
                kept = self._kept in jobs
            gone = self._kernel_gone()  # outside the lock: it may ask the cluster
            if gone is None and not kept:
                # Kept ranks (--keep) wait between cells without a call from the kernel for
                # as long as the user reads: silence says nothing about them; they end with
                # this actor when Ray ends the kernel's connection.
                gone = time.monotonic() - self._polled > SILENT
            if not gone:
                continue
            with self._lock:
                for attempt, job in jobs.items():
                    if self._jobs.get(attempt) is job:
                        log.warning("the kernel is gone: ending its job %s on this node", attempt)
                        self._drop(attempt)

    def describe(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "cuda": visible_cuda(), "pid": os.getpid()}

    # -- the working directory, where this node does not share it ------------------------------
    def sees(self, path: str, content: bytes) -> bool:
        """Whether this node sees the kernel's marker file ``path`` with ``content``: it shares
        the kernel's working directory."""
        try:
            with open(path, "rb") as f:
                return f.read(len(content) + 1) == content
        except OSError:
            return False

    def workdir_need(self, cwd: str, manifest: dict) -> list[str]:
        """The paths of the kernel's ``manifest`` of ``cwd`` that this node's copy lacks."""
        self._polled = time.monotonic()  # the kernel is alive
        held = self._copies.get(cwd, (None, {}))[1]
        return workdir_sync.diff(held, manifest)[0]

    def workdir_update(self, cwd: str, manifest: dict, entries: list) -> str:
        """Bring this node's copy of ``cwd`` to ``manifest`` (``entries``: what it lacked);
        returns the copy's path, where this node's processes start."""
        import tempfile

        self._polled = time.monotonic()
        path, held = self._copies.get(cwd, (None, {}))
        if path is None:
            try:
                top = tempfile.mkdtemp(prefix=f"{workdir_sync.COPY_PREFIX}{os.getpid()}-")
            except OSError as exc:
                raise jobdir.no_room("copy the working directory", exc) from None
            path = os.path.join(top, os.path.basename(cwd.rstrip(os.sep)) or "workdir")
            os.mkdir(path)
        failed = workdir_sync.apply(path, entries, workdir_sync.diff(held, manifest)[1])
        self._copies[cwd] = (path, workdir_sync.scan(path))
        if failed:
            from taas.errors import LaunchError

            raise LaunchError(f"could not copy {len(failed)} path(s) of the working directory to "
                              f"node {self.ip} (like {failed[0]!r}): is {os.path.dirname(path)} full?")
        return path

    def workdir_changes(self, cwd: str) -> tuple[list, list[str]]:
        """What the job changed in this node's copy of ``cwd``: ``(entries, deleted paths)``."""
        self._polled = time.monotonic()
        path, held = self._copies.get(cwd, (None, {}))
        if path is None:
            return [], []
        now = workdir_sync.scan(path)
        changed, deleted = workdir_sync.diff(held, now)
        self._copies[cwd] = (path, now)
        return workdir_sync.pack(path, now, changed), deleted

    def layer_entries(self, attempt: str | None = None) -> list[tuple[str, list]]:
        """The job's ``--storage layer`` uppers as entries, for a kernel that cannot read them."""
        self._polled = time.monotonic()
        return [(name, workdir_sync.read_tree(upper)) for name, upper in self.layers(attempt)]

    def _drop_copies(self) -> None:
        for path, _ in self._copies.values():
            jobdir.remove(os.path.dirname(path))
        self._copies.clear()

    # -- rendezvous -----------------------------------------------------------------------
    def host_store(self, attempt: str, world: int) -> tuple[str, int]:
        """A fresh TCPStore for ``attempt`` on this node's address, port 0: ``(ip, port)``."""
        store, port = rendezvous.agent_store(world, host=self.ip)
        self._stores[attempt] = store
        return self.ip, port

    def close_store(self, attempt: str) -> None:
        self._stores.pop(attempt, None)  # its listening socket closes with it

    # -- a job's share on this node ---------------------------------------------------------
    def start(self, spec: LaunchSpec, files: dict, *shared: bytes) -> dict[str, int]:
        """Start this node's processes of an attempt: ``spec`` without its files (``files``
        come through the object store once for all nodes) and without the kernel's shared fds
        (``shared``: their bytes, made into memory files here).  Returns key -> pid."""
        fds = []
        try:
            for data in shared:
                fd = os.memfd_create("taas-shared", os.MFD_CLOEXEC)
                fds.append(fd)
                _write_all(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
            procs = tuple(dataclasses.replace(p, env=self._env(p.env)) for p in spec.processes)
            spec = dataclasses.replace(spec, processes=procs, files=files, shared_fds=tuple(fds),
                                       placed=True)
            self._polled = time.monotonic()  # the kernel polls from now on
            ranked = any(p.rank is not None for p in spec.processes)
            with self._lock:
                for attempt in list(self._jobs):
                    if (attempt in self._ranked) == ranked:  # a previous attempt the kernel did not close
                        self._drop(attempt)
                job = self._jobs[spec.attempt] = self._launcher.start(spec)
                if ranked:
                    self._ranked.add(spec.attempt)
                    if any(p.env.get("TAAS_KEEP") == "1" for p in spec.processes):
                        self._kept = spec.attempt
                self._specs[spec.attempt] = spec.cleanups
                self._record()
                # The kernel polls once this call returns: a long start (a fresh start
                # process still importing torch) is no silence of the kernel's.
                self._polled = time.monotonic()
                return job.pids
        finally:
            for fd in fds:
                os.close(fd)

    def _record(self) -> None:
        """If Ray ends us before the jobs' own clean-up ran, our watcher runs it (under the lock)."""
        hooks = [hook for attempt in self._jobs for hook in self._specs.get(attempt, ())]
        node_watch.record(hooks, *(job.job_dir for job in self._jobs.values()))

    def _drop(self, attempt: str) -> None:
        """Close job ``attempt`` and forget it (under the lock)."""
        job = self._jobs.pop(attempt, None)
        self._ranked.discard(attempt)
        self._specs.pop(attempt, None)
        if self._kept == attempt:
            self._kept = None
        if job is not None:
            job.close()

    @property
    def _job(self):
        """The handle of the job started last, or None."""
        return next(reversed(list(self._jobs.values())), None)

    def _job_of(self, attempt: str | None = None):
        """Job ``attempt``'s handle (None: the one started last), or None."""
        return self._job if attempt is None else self._jobs.get(attempt)

    def _holding(self, key: str):
        """The job that runs process ``key`` here (keys are unique among an agent's jobs)."""
        return next((job for job in reversed(list(self._jobs.values())) if key in job.keys), None)

    def _env(self, env: dict) -> dict:
        # TAAS_DATA_HOST: where a data relay on this node listens (loader workers reach it).
        out = dict(env, TAAS_NODE_ID=self.node_id, TAAS_DATA_HOST=self.ip)
        if self._ifname:  # the interface of the node's address, for gloo's and NCCL's sockets
            out.setdefault("GLOO_SOCKET_IFNAME", self._ifname)
            out.setdefault("NCCL_SOCKET_IFNAME", self._ifname)
        return out

    def events(self, timeout: float, attempt: str | None = None) -> tuple[list, bool]:
        """Output and exits of job ``attempt``'s processes on this node, waiting up to
        ``timeout`` s for the first (a long poll); and whether the job is finished (every
        process exited, all read)."""
        deadline = time.monotonic() + timeout
        self._polled = time.monotonic()
        while True:
            with self._lock:
                job = self._job_of(attempt)
                if job is None:
                    return [], True
                out = list(job.events(0))
                finished = job.finished
                fd = job.fileno()
            now = time.monotonic()
            if out or finished or now >= deadline:
                return out, finished
            # The wait is outside the lock: a kept cell's lost() and next_cell(), and stop(),
            # must not queue behind a long poll (they did, ~45 ms a call, when it read under it).
            _wait_readable(fd, min(_SLICE, deadline - now))

    def stop(self, grace: float, attempt: str | None = None) -> None:
        self._polled = time.monotonic()  # the kernel is alive
        with self._lock:
            job = self._job_of(attempt)
            if job is not None:
                job.stop(grace)

    def fetch(self, key: str, name: str) -> bytes | None:
        self._polled = time.monotonic()  # the kernel is alive
        job = self._holding(key)
        return job.fetch(key, name) if job is not None else None

    def request_stacks(self, keys: list[str]) -> list[str]:
        self._polled = time.monotonic()  # the kernel is alive
        asked: list[str] = []
        for job in list(self._jobs.values()):
            mine = [k for k in keys if k in job.keys]
            if mine:
                asked += job.request_stacks(mine)
        return asked

    def answer(self, key: str, reply) -> bool:
        """The kernel's answer to what rank ``key`` asked (its input() or pdb prompt)."""
        self._polled = time.monotonic()  # the kernel is alive
        job = self._holding(key)
        return job.answer(key, reply) if job is not None else False

    def layers(self, attempt: str | None = None) -> list[tuple[str, str]]:
        """Paths on this node; the kernel reads them only where nodes share the filesystem."""
        self._polled = time.monotonic()  # the kernel is alive
        job = self._job_of(attempt)
        return job.layers() if job is not None else []

    # -- kept ranks (--keep): the local job's own calls, under the lock ------------------------
    def next_cell(self, files: dict, payload: str, result: str) -> None:
        """The next cell for this node's kept ranks (LocalJob.next_cell: LaunchError when one
        of them ended since the last cell)."""
        self._polled = time.monotonic()  # the kernel is alive
        with self._lock:
            job = self._jobs.get(self._kept or "")
            if job is None:
                from taas.errors import KeptRanksGone

                raise KeptRanksGone(f"the kept ranks on node {self.ip} were ended")
            job.next_cell(files, payload, result)

    def lost(self) -> str | None:
        """Why this node's kept ranks can run no cell any more, or None."""
        self._polled = time.monotonic()
        with self._lock:
            job = self._jobs.get(self._kept or "")
            if job is None:
                return f"the kept ranks on node {self.ip} were ended"
            return job.lost()

    def interrupt(self, keys: list[str]) -> list[str]:
        self._polled = time.monotonic()
        sent: list[str] = []
        for job in list(self._jobs.values()):  # no lock: an interrupt must not wait for a long poll
            mine = [k for k in keys if k in job.keys]
            if mine:
                sent += job.interrupt(mine)
        return sent

    def memory(self) -> dict[str, int]:
        """Resident memory (bytes) of each running process of this node's kept ranks' share."""
        self._polled = time.monotonic()
        job = self._jobs.get(self._kept or "") or self._job
        return job.memory() if job is not None else {}

    def close(self, attempt: str | None = None) -> None:
        """End job ``attempt`` (None: every job of this agent)."""
        with self._lock:
            for key in list(self._jobs) if attempt is None else [attempt]:
                self._drop(key)
            if self._jobs:
                self._record()

    def shutdown(self) -> None:
        self.close()
        self._drop_copies()
        self._stores.clear()
        self._launcher.shutdown()
        node_watch.clear()  # the job's own clean-up ran: nothing left for the watcher


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` writes at most ~2 GiB at a time."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _wait_readable(fd: int | None, timeout: float) -> None:
    """Until ``fd`` (a job's :meth:`~taas.launch.api.JobHandle.fileno`) is readable, at most
    ``timeout`` s.  It may be closed meanwhile by another call (the job's close): then a
    moment's pause, and the caller looks again."""
    if fd is None:
        time.sleep(min(timeout, 0.005))
        return
    if wait_readable(fd, timeout) & CLOSED:
        time.sleep(0.001)  # closed meanwhile
