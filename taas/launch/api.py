"""The launcher contract: place a job's processes, give them a rendezvous, carry their files.

A *job attempt* is a set of processes started together and stopped together: the N ranks and,
when the cell uses registered loaders, the loader workers.  Each process is described by a
:class:`ProcessSpec` (what to run) and becomes a running process identified by its ``key``
(``"rank0"``, ``"loader:train/1"``) -- the same split as torch elastic's ``WorkerSpec`` and
``Worker``.

A :class:`Launcher` turns a :class:`LaunchSpec` into a :class:`JobHandle`.  The launcher owns
everything about *where*:

- **placement**: which machine (and which GPU) each process runs on;
- **rendezvous**: it hosts or chooses the job's store and gives every rank torchrun's
  environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``; see :mod:`taas.launch.rendezvous`);
- **files**: it puts :attr:`LaunchSpec.files` (the payload) where each process finds them and
  brings back what a process left for the kernel (its failure report, fault dump, rank 0's
  results) through :meth:`JobHandle.fetch` -- the caller never shares a directory with the
  processes;
- **topology** (:meth:`Launcher.topology`): a plain value saying which node each rank will
  run on, from which the session picks the data plane's transport; and the clean-up of the
  transport's resources (:attr:`LaunchSpec.cleanups`).

The caller (:mod:`taas.supervisor.supervisor`) sees only this module: no pids, fork, process groups,
loopback or shared filesystem.

The process side of the contract: a process runs ``entry(spec)`` with ``spec`` its
:class:`ProcessSpec`, in the notebook's working directory (or what its ``storage`` makes of it),
with ``TAAS_JOB_DIR`` naming *its* directory: the launcher has put the job's files there before
the process starts and collects the files it leaves for the kernel (:data:`RESULT`,
:func:`error_name`, :func:`fault_name`) from it after the process ends (whether the directory
is shared by the job's processes is the launcher's business: write only your own names).
``TAAS_EVENTS_FD`` is a pipe for JSON event lines (:mod:`taas.launch.process.events`); stdout
and stderr stream to the kernel.

Life of a process, as the handle reports it::

    spawned --(exits by itself)--> ProcessExit(returncode)      0: success
                                                                >0: exit code
                                                                <0: killed by signal -code
    spawned --stop()--> SIGTERM to everything it started --grace--> SIGKILL --> ProcessExit

The local launcher (:mod:`taas.launch.local.launcher`) forks processes from a warm start process; a
multi-node launcher implements the same contract.

**Kept ranks** (``--keep``; optional, :attr:`Launcher.keeps_ranks`).  A kept job's ranks do
not exit after their cell: they say ``done`` (``failed`` when the cell raised) on the events
pipe and wait for the next cell (:mod:`taas.launch.process.cells`).  The caller keeps the
handle open between cells and, per cell, calls :meth:`JobHandle.next_cell` (the cell's payload
and result file names, fresh per cell) and, on Ctrl-C, :meth:`JobHandle.interrupt` (SIGINT to
the ranks' main threads: KeyboardInterrupt in the cell's code).  The ranks end with
:meth:`JobHandle.stop`, as any job's; a launcher without kept ranks refuses ``--keep``.
A kept cell that reads registered loaders starts its loader workers as a job of their own
while the kept job lives: the launcher keeps each job's events to that job's handle (the
local one routes its start process's messages per job), and :meth:`JobHandle.fileno` lets
the caller wait on both handles at once.
What ``%taas`` shows of them comes through the handle too (:meth:`JobHandle.memory`,
:meth:`JobHandle.reserved`): the caller never reads a process's machine itself.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Iterable, Union

from taas.errors import LaunchError

# What a process may leave in its directory for the kernel (JobHandle.fetch names).
RESULT = "result.pkl"  # rank 0's results


def error_name(key: str) -> str:
    """A process's failure report (JSON, :mod:`taas.launch.process.report`)."""
    return f"{key}.error.json"


def fault_name(key: str) -> str:
    """A process's fault dump (faulthandler's text, when a signal killed it)."""
    return f"{key}.fault"


@dataclass(frozen=True)
class ProcessSpec:
    """What one process of a job runs.

    ``entry`` is ``"package.module:function"``; the child calls ``function(spec)`` and exits
    with the integer it returns.  ``env`` is added to the child's environment (the launcher
    adds the rendezvous variables to a rank's).  ``rank`` is the process's global rank, or None
    for a process that is not a rank (a loader worker).  ``storage`` is what the process may do
    to the working directory (:mod:`taas.workdir.storage`): ``"shared"`` write it (rank 0),
    ``"layer"`` write a private layer of it that is merged back after the job, ``"strict"``
    only read it.  ``role`` is what the process is (:data:`taas.io.keys.RANK`, ``LOADER``,
    ``RELAY``); ``node`` pins it to that node of the job's :class:`Topology` (a transport's
    relay), or None to let the launcher place it.  The ``key`` is only its name.
    """

    key: str
    entry: str
    env: dict[str, str] = field(default_factory=dict)
    storage: str = "shared"  # shared | layer | strict
    args: tuple = ()
    rank: int | None = None
    role: str = "rank"  # rank | loader | relay
    node: int | None = None


def attempt_id(job_id: str, restart: int) -> str:
    """The id of attempt ``restart`` of job ``job_id``: what names its processes' resources."""
    return job_id if restart == 0 else f"{job_id}-{restart}"


@dataclass(frozen=True)
class Topology:
    """Where a job's ranks will run, as a plain value (:meth:`Launcher.topology`).

    ``rank_nodes[r]``: the node number rank r runs on; ``node_ids[n]``: node n's launcher id
    (``TAAS_NODE_ID``).  ``host``: the kernel's address as the nodes reach it.
    ``kernel_machine``: every process of the job runs on the kernel's machine, so shared memory
    reaches them all (the session then picks the shared-memory transport, else TCP)."""

    rank_nodes: tuple[int, ...]
    node_ids: tuple[str, ...] = ("local",)
    host: str = "127.0.0.1"
    kernel_machine: bool = True


@dataclass(frozen=True)
class LaunchSpec:
    """One attempt of a job to start.

    ``files``: name -> bytes the launcher puts in every process's directory before it starts
    (``payload.pkl``).  ``shared_fds``: open files of the caller (read-only data, such as the
    notebook's resident big tensors) that every process of the job gets as open files of its
    own; a process finds them, in this order, by the numbers listed in its ``TAAS_SHARED_FDS``
    environment variable (``"7,8"``).  On this machine the last one may be the job's results
    channel, a Unix socket rank 0 sends its big results' memory files on
    (:mod:`taas.job.memory.returns`; ``TAAS_RESULT_CHANNEL`` is its index): a launcher passes
    every shared fd as it is, whatever it is.  The caller keeps its own fds and may close them once
    :meth:`Launcher.start` returned.  ``device``: ``"cuda"`` places one rank per GPU.
    ``restart``/``max_restarts``: which attempt this is (``TORCHELASTIC_RESTART_COUNT``).

    ``cleanups``: hooks that free what the job holds outside its processes (the data plane's
    shared memory), each a picklable ``("package.module:function", args)``.  The launcher calls
    ``function(*args)`` in a process of its own when the attempt is over (every process ended)
    and when the kernel died with the attempt running; a hook must be idempotent, since the
    kernel frees the same things itself when it can, and its errors are ignored.

    ``placed``: the rendezvous was decided elsewhere.  A multi-node launcher
    (:mod:`taas.launch.ray.launcher`) hands each node's share of a job to that node's local
    launcher with every rank's ``env`` already carrying torchrun's variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store it hosts...)
    and the socket interface to use; the local launcher then hosts no store, keeps those
    variables, and adds only where its files are (``TAAS_JOB_DIR``, ``TAAS_SCRATCH``).
    ``world_size`` is then this node's count of ranks, not the job's."""

    job_id: str
    cwd: str
    processes: tuple[ProcessSpec, ...]
    files: dict[str, bytes] = field(default_factory=dict)
    shared_fds: tuple[int, ...] = ()
    device: str = "cpu"
    restart: int = 0
    max_restarts: int = 0
    cleanups: tuple = ()
    placed: bool = False

    @property
    def world_size(self) -> int:
        return sum(1 for p in self.processes if p.rank is not None)

    @property
    def attempt(self) -> str:
        return attempt_id(self.job_id, self.restart)


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a process wrote to ``stream`` (``"stdout"``, ``"stderr"`` or ``"events"``)."""

    key: str
    stream: str
    data: bytes


@dataclass(frozen=True)
class ProcessExit:
    key: str
    pid: int  # for logs only
    returncode: int  # negative: killed by signal -returncode


Event = Union[OutputChunk, ProcessExit]


class JobHandle(abc.ABC):
    """A running attempt.  Not thread-safe: one supervisor drives it."""

    @property
    @abc.abstractmethod
    def keys(self) -> list[str]:
        """The key of every process started, ranks first."""

    @abc.abstractmethod
    def events(self, timeout: float) -> Iterable[Event]:
        """Output and exits that happened, waiting at most ``timeout`` s for the first one.

        After every process has exited and all output has been read, returns nothing.
        """

    @abc.abstractmethod
    def drain(self, timeout: float = 2.0) -> list[Event]:
        """What output is left once every process exited (or was stopped), waiting at most
        ``timeout`` s for it."""

    @abc.abstractmethod
    def stop(self, grace: float = 1.0) -> None:
        """End every process of the job (SIGTERM, then SIGKILL after ``grace`` s) and every
        process they started; returns once all are gone.  Idempotent."""

    @abc.abstractmethod
    def fetch(self, key: str, name: str) -> bytes | None:
        """A file process ``key`` left for the kernel (:data:`RESULT`, :func:`error_name`,
        :func:`fault_name`), or None.  Valid until :meth:`close`."""

    @abc.abstractmethod
    def request_stacks(self, keys: Iterable[str]) -> list[str]:
        """Ask each running process in ``keys`` for its Python stack (the answer arrives as a
        ``"stack"`` event line, :mod:`taas.launch.process.stacks`); returns the keys that were asked."""

    @abc.abstractmethod
    def layers(self) -> list[tuple[str, str]]:
        """``(key, local path)`` of the ``upper`` directory of every process that ran with
        ``storage="layer"``, readable here once the processes ended, until :meth:`close`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the attempt's resources (pipes, store, files).  Calls ``stop()`` first."""

    def answer(self, key: str, reply) -> bool:
        """Give process ``key`` the answer to the question it asked on its events pipe (an
        ``ask`` line: ``input()`` or pdb in a rank), a
        :class:`taas.launch.process.stdin.Answer`, written where the process runs
        (:func:`taas.launch.process.stdin.answer`); False when it cannot be reached.  Optional:
        a launcher without it leaves ranks' ``input()`` unanswerable (they are told so)."""
        return False

    def fileno(self) -> int | None:
        """Optional: a descriptor that turns readable when :meth:`events` may have something
        new, so that a caller can wait on several handles at once; None: there is none."""
        return None

    # -- kept ranks (optional: Launcher.keeps_ranks) -------------------------------------------
    def next_cell(self, files: dict[str, bytes], payload: str, result: str) -> None:
        """Kept ranks: put ``files`` in every process's directory (removing the previous
        cell's failure reports) and tell every rank to run the payload file ``payload``, rank 0
        writing its results to ``result`` (fetched with :meth:`fetch`).  Raises LaunchError
        (one line) when a process of the job has ended since the last cell: the kept state is
        lost.  Output the ranks wrote between cells comes with the next :meth:`events`."""
        raise LaunchError("this launcher cannot keep ranks between cells")

    def lost(self) -> str | None:
        """Kept ranks: why this job can no longer run a cell (in words: which process ended,
        how), or None while every process is there.  Cheap; called before each kept cell."""
        return None

    def interrupt(self, keys: Iterable[str]) -> list[str]:
        """Kept ranks: raise KeyboardInterrupt in the main thread of each running process in
        ``keys`` (SIGINT); returns the keys that were signalled."""
        return []

    def running_pids(self) -> dict[str, int]:
        """Kept ranks: each running process's pid on its machine (for logs: on a cluster the
        machine is not the kernel's)."""
        return {}

    def cell_done(self) -> None:
        """Kept ranks: every rank came back from a cell (whether it raised or not).  What the
        cell wrote where the kernel cannot see it comes to the notebook's working directory
        now, as a one-cell job's does when its processes end (a cluster node's copy of the
        directory); nothing to do where the ranks write the directory itself."""

    def memory(self) -> dict[str, int]:
        """Kept ranks: each running process's resident memory in bytes, wherever it runs, for
        ``%taas`` (the launcher measures it where the process is)."""
        return {}

    def reserved(self) -> str | None:
        """Kept ranks: what the job holds for its ranks beyond their processes while they live,
        in words for ``%taas`` (a cluster's reserved GPUs), or None."""
        return None


def process_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name, its state letter first (so
    ``[19]`` is its start time), or None when it is gone or unreadable.  The name may hold
    spaces and parentheses: the last ")" ends it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def run_cleanups(hooks) -> None:
    """Run :attr:`LaunchSpec.cleanups` hooks, ``("module:function", args)`` each, as a
    launcher does when an attempt is over or the kernel died; a hook's error is ignored (each
    is idempotent, and the rest must still run)."""
    import importlib

    for entry, args in hooks:
        try:
            module, _, name = entry.partition(":")
            getattr(importlib.import_module(module), name)(*args)
        except Exception:  # broad: whatever a hook raises; the kernel frees the same things too
            pass


class Launcher(abc.ABC):
    """Starts jobs.  A launcher may keep warm state (a start process) across jobs."""

    def warm(self) -> None:
        """Prepare for the next job in the background (the local launcher starts its start
        process); optional."""

    #: Where this launcher runs jobs, in the words of a message ("this machine", "the cluster").
    where: str = "this machine"

    #: Its handles implement the kept-ranks part (:meth:`JobHandle.next_cell`, ``interrupt``).
    keeps_ranks: bool = False

    def check(self, processes: int, device: str = "cpu", ranks: int | None = None) -> None:
        """Raise LaunchError (one line) if a job of ``processes`` processes (``ranks`` of them
        ranks, when the caller knows) cannot run here; called before anything is written or
        started."""

    def cuda_devices(self) -> int:
        """How many CUDA devices the ranks can use, one rank each (the count
        :func:`taas.directive.resolve_world` decides device and backend with): by default this
        machine's.  A cluster launcher counts the GPUs of its nodes that its ranks see as CUDA
        devices (0 on a cluster that only advertises GPUs: the ranks run gloo on CPU)."""
        return cuda_device_count()

    def describe(self) -> list[str]:
        """Lines for ``%taas``: where jobs run (a cluster lists its nodes, GPUs, CPUs)."""
        gpus = self.cuda_devices()
        return [f"taas: {gpus} CUDA GPU(s) visible; "
                + ("NCCL ranks, one GPU each" if gpus else "no CUDA: ranks run on CPU with gloo")]

    @abc.abstractmethod
    def start(self, spec: LaunchSpec) -> JobHandle:
        """Place and start every process of ``spec``; raises LaunchError if that is
        impossible, leaving nothing behind."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop any running job and release warm state."""

    @abc.abstractmethod
    def topology(self, world: int) -> Topology:
        """Where the next job's ``world`` ranks will run.  The session asks *before*
        :meth:`start` (it picks the data plane's transport from it and puts the loaders'
        settings into the job's payload), so a multi-node launcher plans the ranks' placement
        here and its :meth:`start` places them the same way, or raises LaunchError if the
        cluster changed in between.  A transport's own processes (``role="relay"``) name the
        node they go on (``ProcessSpec.node``, numbered as in the topology)."""


def cuda_device_count() -> int:
    """This machine's CUDA devices (the one place taas counts them), through NVML: no CUDA
    context, no ``cuInit`` (``torch.cuda.is_available()`` would initialise the driver, and a
    process that did must never fork ranks).  Only where NVML itself fails (no
    ``libnvidia-ml``) does torch fall back to ``cudaGetDeviceCount``.  Called only in the
    kernel (session, ``check_gpus``, ``%taas``), which never forks ranks: it starts the start
    process as a fresh interpreter (:mod:`taas.launch.local.forksafe`)."""
    # Counted once per CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER setting: torch loads and
    # initialises NVML on every call before CUDA is initialised (milliseconds on a machine with
    # many GPUs, paid by every cell, kept cells too), and only those two settings change what
    # a process sees.
    key = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
    count = _counted.get(key)
    if count is None:
        from taas.shield import import_shielded

        # An interrupt must not cut the kernel's first `import torch` in half (taas.shield).
        import_shielded("torch", "torch.distributed")
        import torch

        count = _counted[key] = max(0, torch.cuda.device_count())  # NVML first (torch's own rule)
    return count


_counted: dict[tuple[str | None, str | None], int] = {}  # cuda_device_count's, per setting
