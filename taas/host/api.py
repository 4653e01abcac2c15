"""What crosses between a kernel and a job host, both ways, as files in the job's record folder.

* :class:`Request` (``request.pkl``): the cell and what it reads, written by the kernel before
  the host starts; the host removes it once read.
* :class:`Returned` (``results.pkl``): rank 0's names and ``Out[]``, each pickled on its own
  (one that cannot be read costs itself and a note), written by the host when the job succeeded.
* :class:`Failure` (``failure.json``): a failed job's rendering (the root cause's traceback with
  the cell's own lines), so that an attaching notebook shows what the cell would have shown.
* On the host's socket, while the kernel that started it waits: :class:`Take` (run this job),
  :class:`Running` (its ranks run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAILURE = "failure.json"


@dataclass(frozen=True)
class Request:
    source: str  # the cell body
    options: str  # the directive's argument line ("--gpus 2 --detach")
    names: bytes  # the notebook values the cell reads: one cloudpickle of a dict
    filename: str  # the cell's file name in the kernel's compiler cache
    label: str | None  # how tracebacks name it ("Cell In[7]"); None: the file name
    first_line: int  # the body's first line number in that file
    cwd: str  # the notebook's working directory
    loaders: dict = field(default_factory=dict)  # name -> (prefetch, buffer_mb): registered loaders
    text: str | None = None  # the cell as typed, when ``source`` is IPython's translation of it


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
    as SCM_RIGHTS).  From then on the host needs nothing of the kernel."""

    folder: str


@dataclass(frozen=True)
class Running:
    """host -> kernel: the ranks of job ``job`` run (or it ended first: ``ended``)."""

    job: str
    ended: bool = False


def encode(message: Take | Running) -> bytes:
    import json

    return json.dumps({"kind": type(message).__name__, **message.__dict__}).encode()


def decode(data: bytes) -> Take | Running | None:
    import json

    try:
        fields = json.loads(data)
        kind = {"Take": Take, "Running": Running}[fields.pop("kind")]
        return kind(**fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
