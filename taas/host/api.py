"""What crosses between a kernel and a job host, both ways, as files in the job's record folder.

* :class:`Request` (``request.pkl``): the cell and what it reads, written by the kernel before
  the host starts; the host removes it once read.
* :class:`Returned` (``results.pkl``): rank 0's names and ``Out[]``, each pickled on its own
  (one that cannot be read costs itself and a note), written by the host when the job succeeded.
* :class:`Failure` (``failure.json``): a failed job's rendering (the root cause's traceback with
  the cell's own lines), so that an attaching notebook shows what the cell would have shown.
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
