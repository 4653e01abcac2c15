"""One node's agent for the Ray launcher: the local launcher, kept warm, driven by actor calls.

:class:`NodeAgent` is a plain class; :mod:`taas.launch.ray_launcher` makes it a Ray actor, one
per node (pinned with ``NodeAffinitySchedulingStrategy``, ``num_cpus=0``, owned by the
kernel's Ray connection, so it dies with it).  It wraps a :class:`~taas.launch.local.LocalLauncher`:
its warm start process, fork-ahead, pipes, process groups, parent-death signals and subreaper
work on every node as on one machine.  Ranks are children of that start process, never Ray
workers; the start process's guard has the agent as its "kernel", so a dead agent takes its
node's processes along.

Calls come from the kernel concurrently (a threaded actor): one long-poll :meth:`events` at a
time, and :meth:`stop`, :meth:`fetch`, :meth:`request_stacks` meanwhile.  The local job handle
is not thread-safe, so :meth:`events` reads it in 50 ms slices under a lock, and a stop waits
at most one slice.

Node 0's agent also hosts the attempt's rendezvous store (:meth:`host_store`), on its node's
address, port 0: torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` arrangement across nodes.

Nothing here imports Ray: the class is tested as it is, on one machine.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import threading
import time

from taas.launch import rendezvous
from taas.launch.api import LaunchSpec
from taas.launch.local import LocalJob, LocalLauncher

_SLICE = 0.05  # how long one read of the job's pipes holds the lock
ORPHANED = 5.0  # seconds without an events() call from the kernel, while a job runs: it is gone

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
    def __init__(self, node_id: str, ip: str):
        # Every process taas starts on this node (the start process and all it forks) says
        # which Ray node it runs on.
        os.environ["TAAS_NODE_ID"] = node_id
        self.node_id = node_id
        self.ip = ip
        self._ifname = rendezvous.ifname_for(ip)
        self._launcher = LocalLauncher()
        self._launcher.warm()  # the start process imports torch while the kernel gets ready
        self._lock = threading.Lock()
        self._job: LocalJob | None = None
        self._stores: dict[str, object] = {}
        self._polled = time.monotonic()  # the kernel's last events() call
        threading.Thread(target=_import_torch, name="taas-agent-torch", daemon=True).start()
        threading.Thread(target=self._watch_kernel, name="taas-agent-watchdog", daemon=True).start()

    def _watch_kernel(self) -> None:
        """While a job runs here, the kernel keeps an events() call outstanding (a new one at
        least every second).  If none came for ORPHANED s, the kernel is gone (killed, its node
        lost): end the job's processes now rather than when Ray gets round to ending this
        actor, which can take many seconds on a busy cluster."""
        while True:
            time.sleep(1.0)
            with self._lock:
                job = self._job
                if job is None or job.finished or time.monotonic() - self._polled < ORPHANED:
                    continue
                log.warning("no word from the kernel for %.0f s: ending its job on this node", ORPHANED)
                self._job.close()
                self._job = None

    def describe(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "cuda": visible_cuda(), "pid": os.getpid()}

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
            with self._lock:
                if self._job is not None:  # a previous attempt the kernel did not close
                    self._job.close()
                    self._job = None
                self._job = self._launcher.start(spec)
                # The kernel polls once this call returns: a start that took longer than
                # ORPHANED s (a fresh start process still importing torch) is no silence.
                self._polled = time.monotonic()
                return self._job.pids
        finally:
            for fd in fds:
                os.close(fd)

    def _env(self, env: dict) -> dict:
        # TAAS_DATA_HOST: where a data relay on this node listens (loader workers reach it).
        out = dict(env, TAAS_NODE_ID=self.node_id, TAAS_DATA_HOST=self.ip)
        if self._ifname:  # the interface of the node's address, for gloo's and NCCL's sockets
            out.setdefault("GLOO_SOCKET_IFNAME", self._ifname)
            out.setdefault("NCCL_SOCKET_IFNAME", self._ifname)
        return out

    def events(self, timeout: float) -> tuple[list, bool]:
        """Output and exits of this node's processes, waiting up to ``timeout`` s for the first
        (a long poll); and whether the job is finished (every process exited, all read)."""
        deadline = time.monotonic() + timeout
        self._polled = time.monotonic()
        while True:
            with self._lock:
                job = self._job
                if job is None:
                    return [], True
                out = list(job.events(_SLICE))
                finished = job.finished
            if out or finished or time.monotonic() >= deadline:
                return out, finished
            time.sleep(0.001)  # let a waiting stop() take the lock

    def stop(self, grace: float) -> None:
        self._polled = time.monotonic()  # the kernel is alive
        with self._lock:
            if self._job is not None:
                self._job.stop(grace)

    def fetch(self, key: str, name: str) -> bytes | None:
        self._polled = time.monotonic()  # the kernel is alive
        job = self._job
        return job.fetch(key, name) if job is not None else None

    def request_stacks(self, keys: list[str]) -> list[str]:
        self._polled = time.monotonic()  # the kernel is alive
        job = self._job
        return job.request_stacks(keys) if job is not None else []

    def layers(self) -> list[tuple[str, str]]:
        """Paths on this node; the kernel reads them only where nodes share the filesystem."""
        job = self._job
        return job.layers() if job is not None else []

    def close(self) -> None:
        with self._lock:
            if self._job is not None:
                self._job.close()
                self._job = None

    def shutdown(self) -> None:
        self.close()
        self._stores.clear()
        self._launcher.shutdown()


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` writes at most ~2 GiB at a time."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
