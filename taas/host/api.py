"""What crosses between a kernel and a job host, both ways, as files in the job's record folder.

* :class:`Prepared` (``job.pkl``; on a Ray cluster the host actor's ``start`` argument, its
  shared files as bytes): a job made by the kernel exactly as an
  attached cell's (the cell read, its values shipped, its GPUs leased): the host runs it as it
  is, with the supervisor an attached job has (``--keep``: as the first cell on kept ranks,
  which the host then keeps for a kernel to adopt); its shared files (big values, the GPU
  lease) ride along with :class:`Take`.  The host removes it once read.
* :class:`Returned` (``results.pkl``): rank 0's names and ``Out[]``, each pickled on its own
  (one that cannot be read costs itself and a note), written by the host when the job succeeded.
* :class:`Failure` (``failure.json``): a failed job's rendering (the root cause's traceback with
  the cell's own lines), so that an attaching notebook shows what the cell would have shown.
* On the host's socket, while the kernel that started it waits: :class:`Take` (run this job),
  :class:`Running` (its ranks run).
* On the zygote's socket (zygote.py): :class:`Fork` (fork a job host that waits for a job).
* On a kept job's socket (``--keep --detach``; :mod:`taas.host.channel` frames them), between
  the host and the one kernel that adopted its kept ranks::

      kernel                                   host
      Hello(token, pid, notebook)  ──────>     the secret checked first (hmac.compare_digest)
                                   <──────     Welcome(job, ranks, ..., kept id) or Refused(line)
      then the frames of the kernel's own job host (below): RunJob(keep, kept) + the Job
      its Session prepared, Show*, Metrics*, Ask/Answer, Interrupt, JobDone [+ CellFailed];
      KeptCall(memory | reserved | release) <── KeptAnswer
                                   <──────     Ended(line): the ranks ended, the host exits

  ``Ended`` comes after a release, and unasked when the ranks end otherwise (their idle limit,
  a cancel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAILURE = "failure.json"
FDS_AT_ONCE = 250  # files per message on a host's socket, the rest in messages of their own (max 253)


@dataclass(frozen=True)
class Prepared:
    job: Any  # taas.job.api.Job, its shared_fds left out (they travel as SCM_RIGHTS with Take)
    sources: dict = field(default_factory=dict)  # the notebook's cells' linecache entries
    labels: dict = field(default_factory=dict)  # a cell's file name -> how tracebacks name it
    shown: tuple = ()  # (stream, text): the notes the kernel's cell showed as it made the job
    keep: float | None = None  # --keep: the ranks stay after it, for a kernel to adopt (idle limit, s)


@dataclass(frozen=True)
class Returned:
    values: dict = field(default_factory=dict)  # name -> cloudpickle bytes
    out: bytes | None = None  # Out[], pickled; None: no Out[]
    has_out: bool = False
    notes: tuple = ()  # one line per value that could not come back


@dataclass(frozen=True)
class Failure:
    summary: str  # one line
    rendered: tuple = ()  # the notebook's traceback lines (ANSI colours kept)
    kind: str = "JobFailed"  # JobFailed, LaunchError, PackagingError, ... (the cell's exception)


# -- the host's socket: a kernel and a host that waits for a job (a warm spare) ------------------
# One SOCK_SEQPACKET socketpair per host, made by the kernel that starts it.  Each message is
# one JSON object; unknown or unreadable messages are ignored by both ends.
@dataclass(frozen=True)
class Take:
    """kernel -> host: run the job whose record folder is ``folder`` (its lock fd rides along
    as SCM_RIGHTS, then a Prepared job's ``fds`` shared files).  From then on the host needs
    nothing of the kernel."""

    folder: str
    fds: int = 0


@dataclass(frozen=True)
class Running:
    """host -> kernel: the ranks of job ``job`` run (or it ended first: ``ended``)."""

    job: str
    ended: bool = False


# -- the zygote's socket: a kernel and its warm process that forks job hosts (zygote.py) -------
@dataclass(frozen=True)
class Fork:
    """kernel -> zygote: fork a job host (a spare, waiting for a :class:`Take`).  Two fds ride
    along as SCM_RIGHTS: the host's end of its socket, and its log (stdout and stderr) until it
    has a job.  ``env``: the kernel's environment now (the host's, as if the kernel started it);
    ``ready``: how many processes its start process forks ahead (0: its default)."""

    env: dict
    ready: int = 0


# -- a kept job's socket (--keep --detach) -----------------------------------------------------
SOCKET = "kept.sock"  # in the record folder (0700), itself 0600
SECRET = "secret"  # the per-job token, 0600: whoever reads it may adopt the kept ranks


@dataclass(frozen=True)
class Hello:
    """kernel -> host, first on every connection: the job's secret, and who asks."""

    token: str
    pid: int
    notebook: str = ""


@dataclass(frozen=True)
class Welcome:
    """host -> kernel: the kept ranks are this kernel's now."""

    job: str
    ranks: int
    device: str
    backend: str
    kept: str = ""  # the kept ranks' job id (RunJob.kept names it)
    limit: float | None = None  # their idle limit (s); None: none
    cells: int = 0  # the cells they ran


@dataclass(frozen=True)
class Refused:
    """host -> kernel: not adopted, and why (one line)."""

    line: str


@dataclass(frozen=True)
class Interrupt:
    """kernel -> host: interrupt the cell running now (not the ranks' life)."""


@dataclass(frozen=True)
class Show:
    """host -> kernel: one call of the Sink protocol (write, progress, display, live, panel)."""

    call: str
    args: list


@dataclass(frozen=True)
class Metrics:
    """host -> kernel: rank ``rank``'s new ``taas.log`` rows ([step, values] pairs)."""

    rank: int
    rows: list


@dataclass(frozen=True)
class CellFailed:
    """host -> kernel: the cell raised; what the notebook shows (as :class:`Failure`)."""

    summary: str
    rendered: list
    error: str  # the exception's class name: JobFailed, KeyboardInterrupt, LaunchError...


@dataclass(frozen=True)
class Ended:
    """host -> kernel: the kept ranks ended (released, their idle limit, a cancel); the host exits."""

    line: str


# -- the kernel's own job host (serve.py, remote.py): every attached job of a kernel -----------
# The same frames, on a socketpair between the kernel and its host child; Interrupt, Show,
# Metrics and CellFailed as above.
@dataclass(frozen=True)
class RunJob:
    """kernel -> host: run the job (a cloudpickled :class:`taas.job.api.Job` is the body; its
    ``shared_fds``, ``fds`` of them, follow as SCM_RIGHTS on one byte); ``labels``: the cell's
    file name -> how tracebacks name it; ``in_place``: the front end updates displays in place."""

    fds: int
    labels: dict
    in_place: bool = True
    keep: float | None = None  # --keep: the cell runs on kept ranks with this idle limit (s)
    kept: str = ""  # the kept ranks' job id it runs on ("": it starts them)


@dataclass(frozen=True)
class KeptCall:
    """kernel -> host, between cells: a question about the kept ranks the host keeps for this
    kernel (``memory``, ``reserved``: for ``%taas``), or ``release`` (Show* may come first: the
    layers' merge notes); the host answers :class:`KeptAnswer`."""

    call: str


@dataclass(frozen=True)
class KeptAnswer:
    value: object = None


@dataclass(frozen=True)
class Ask:
    """host -> kernel: a rank asks the notebook's input box (``input()``, pdb)."""

    prompt: str
    password: bool = False


@dataclass(frozen=True)
class Answer:
    """kernel -> host: the line typed (``text``), or end of input (``eof``), or why none can be
    read (``error``, one line)."""

    text: str | None = None
    eof: bool = False
    error: str | None = None


@dataclass(frozen=True)
class JobDone:
    """host -> kernel: the job's end; the body is a pickled ``(Outcome, loaders, kept)``: the
    supervisor's outcome, the data plane's figures (``DataPlane.figures``), and the kept
    ranks after a ``--keep`` cell (a dict: job_id, world, cells, gpu_mem; None: there are
    none).  ``failed``: a :class:`CellFailed` follows (the job raised; the outcome is how far
    it got).  ``states``: every state the job entered, told here rather than one frame each
    (nothing in the kernel reads them while the job runs; each frame would wake it)."""

    failed: bool = False
    states: list = field(default_factory=list)  # the states the job entered, in order (State values)


WIRE = {kind.__name__: kind for kind in (Hello, Welcome, Refused, Interrupt, Show,
                                         Metrics, CellFailed, Ended, RunJob, Ask,
                                         Answer, JobDone, KeptCall, KeptAnswer)}
SHOWN = frozenset({"write", "progress", "display", "live", "panel"})  # the Sink calls Show may name


def encode(message: Take | Running | Fork) -> bytes:
    import json

    return json.dumps({"kind": type(message).__name__, **message.__dict__}).encode()


def decode(data: bytes) -> Take | Running | Fork | None:
    import json

    try:
        fields = json.loads(data)
        kind = {"Take": Take, "Running": Running, "Fork": Fork}[fields.pop("kind")]
        return kind(**fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
