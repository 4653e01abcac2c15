"""The launcher contract: start a job's processes, watch them, stop them.

A *job* is a set of processes started together and stopped together: the N ranks and, when the
cell uses registered loaders, the loader workers.  Each process is described by a
:class:`ProcessSpec` (what to run) and becomes a running process identified by its ``key``
(``"rank0"``, ``"loader:train/1"``) -- the same split as torch elastic's ``WorkerSpec`` and
``Worker``.

A :class:`Launcher` turns a :class:`LaunchSpec` into a :class:`JobHandle`.  The handle is a
stream of :class:`Event` s -- output chunks and process exits -- that the supervisor
(:mod:`taas.supervise`) consumes until the job is over, and a ``stop()`` that ends every process
of the job (and everything they started) before it returns.

Life of a process, as the handle reports it::

    spawned --(exits by itself)--> ProcessExit(returncode)      0: success
                                                                >0: exit code
                                                                <0: killed by signal -code
    spawned --stop()--> SIGTERM to its process group --grace--> SIGKILL --> ProcessExit

The local launcher (:mod:`taas.launch.local`) forks processes from a warm start process; a
multi-node launcher will implement the same contract.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Union


@dataclass(frozen=True)
class ProcessSpec:
    """What one process of a job runs.

    ``entry`` is ``"package.module:function"``; the child calls ``function(spec)`` and exits
    with the integer it returns.  ``env`` is added to the child's environment.  ``storage`` is
    what the process may do to the working directory (:mod:`taas.worker.storage`):
    ``"shared"`` write it (rank 0), ``"layer"`` write a private layer of it that is merged back
    after the job, ``"strict"`` only read it.
    """

    key: str
    entry: str
    env: dict[str, str] = field(default_factory=dict)
    storage: str = "shared"  # shared | layer | strict
    args: tuple = ()


@dataclass(frozen=True)
class LaunchSpec:
    """A job to start.  ``shared_fds``: open files of the caller (read-only data, such as the
    notebook's resident big tensors) that every process of the job gets as open files of its
    own; a process finds them, in this order, by the numbers listed in its
    ``TAAS_SHARED_FDS`` environment variable (``"7,8"``).  The caller keeps its own fds and
    may close them once :meth:`Launcher.start` returned.

    ``cleanups``: hooks that free what the job holds outside its processes (the data plane's
    shared memory), each a picklable ``("package.module:function", args)``.  The launcher calls
    ``function(*args)`` in a process of its own when the job is over (every process ended) and
    when the kernel died with the job running; a hook must be idempotent, since the kernel
    frees the same things itself when it can, and its errors are ignored."""

    job_id: str
    job_dir: str
    cwd: str
    processes: tuple[ProcessSpec, ...]
    shared_fds: tuple[int, ...] = ()
    cleanups: tuple = ()


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a process wrote to ``stream`` (``"stdout"``, ``"stderr"`` or ``"events"``)."""

    key: str
    stream: str
    data: bytes


@dataclass(frozen=True)
class ProcessExit:
    key: str
    pid: int
    returncode: int  # negative: killed by signal -returncode


Event = Union[OutputChunk, ProcessExit]


class JobHandle(abc.ABC):
    """A running job.  Not thread-safe: one supervisor drives it."""

    @property
    @abc.abstractmethod
    def pids(self) -> dict[str, int]:
        """Process key -> pid, for every process started."""

    @abc.abstractmethod
    def events(self, timeout: float) -> Iterable[Event]:
        """Output and exits that happened, waiting at most ``timeout`` s for the first one.

        After every process has exited and all output has been read, returns nothing.
        """

    @abc.abstractmethod
    def stop(self, grace: float = 1.0) -> None:
        """End every process of the job (SIGTERM, then SIGKILL after ``grace`` s) and every
        process they started; returns once all are gone.  Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the handle's resources (pipes).  Calls ``stop()`` first if needed."""


class Launcher(abc.ABC):
    """Starts jobs.  A launcher may keep warm state (a start process) across jobs."""

    @abc.abstractmethod
    def start(self, spec: LaunchSpec) -> JobHandle:
        """Start every process of ``spec``; raises LaunchError if that is impossible."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop any running job and release warm state."""

    def data_transport(self):
        """The data plane's transport class for jobs of this launcher (a subclass of
        :class:`taas.data.transport.Transport`): how units reach ranks where it puts them."""
        raise NotImplementedError(f"{type(self).__name__} has no data transport")
