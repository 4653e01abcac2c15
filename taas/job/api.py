"""A job as a value: what runs, where, and the policy it runs under.

The session builds a :class:`Job` from a cell (:mod:`taas.session`); the supervisor
(:mod:`taas.supervisor.supervisor`) runs it through its states on a launcher.  Nothing here knows about
processes, IPython or the machine.

    Job
      what    payload (the cell, the notebook's values it reads), data (registered loaders)
      where   World: ranks, device, backend
      policy  Policy: timeout, restarts, stall, storage, output shown, results wanted
    JobStats  what became of it, for ``%taas``
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAYLOAD = "payload.pkl"  # the job's Payload, pickled, in the job directory every process reads


@dataclass(frozen=True)
class World:
    size: int  # ranks
    device: str  # "cuda" | "cpu"
    backend: str  # "nccl" | "gloo"


@dataclass(frozen=True)
class Policy:
    timeout: float | None = None  # whole job, restarts included; None: no limit
    max_restarts: int = 0  # attempts after the first one that failed
    stall: float = 0.0  # seconds without output before the ranks' places are shown; 0: never
    storage: str = "layer"  # what ranks > 0 may write to the working directory
    show: frozenset | None = None  # process keys whose output streams live; None: all
    results: bool = True  # bring rank 0's names and Out[] back


@dataclass
class Job:
    job_id: str
    cwd: str  # the notebook's working directory, where the ranks start
    payload: object  # taas.job.package.Payload, without its data-plane settings
    world: World
    policy: Policy
    data: object = None  # taas.data.plane.DataPlane or None: registered loaders the cell reads
    transport: object = None  # with data: (attempt_id) -> taas.data.transport.Transport, the session's pick
    env: dict = field(default_factory=dict)  # added to every process's environment
    shared_fds: tuple[int, ...] = ()  # read-only files every process gets (big values)
    cleanups: tuple = ()  # hooks that free the job's files if the kernel dies (LaunchSpec.cleanups)


@dataclass
class JobStats:
    """What ``%taas`` says of the last job (taas.status): its world, how it ended, its figures."""

    job_id: str
    world_size: int
    device: str
    backend: str
    wall_s: float = 0.0
    outcome: str = "preparing"  # the supervisor's state (taas.supervisor.supervisor.State), then ok/failed/...
    exit_codes: dict = field(default_factory=dict)
    loaders: list[str] = field(default_factory=list)
    config: str | None = None  # DataSphere '#!NAME' configuration line, if the cell had one
    data: list[str] = field(default_factory=list)  # the data plane's summary lines
    comm_ops: dict = field(default_factory=dict)  # rank key -> operations on its groups (comm)
    restarts: int = 0
    cluster: str | None = None  # the Ray cluster's address, None on this machine
    results: str = ""  # how rank 0's big results came back (CellResult.big), "" when none did
