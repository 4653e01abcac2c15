"""Why a job failed: pick the root cause, render it as the user's own traceback.

Like torch elastic's ``ChildFailedError.get_first_failure()``, the root cause is the earliest
failure: the earliest error report a process wrote, else the first exit the supervisor saw.
A peer's lost connection is a consequence, and so is a process the supervisor stopped.  When
every failure is a lost connection, the cause is a process that *left*: it ended by itself
with code 0 (``sys.exit(0)``, ``os._exit(0)``, the end of the cell) while the others were
still running -- in a collective it never joined.  Every other process gets one line
("rank0: stopped after rank1 failed").

Rendering is pure: frames come from the report files (:mod:`taas.launch.process.report`), source lines
from the kernel's linecache when the rank did not have them (functions defined in other
notebook cells), and ``name_for(filename)`` turns a cell's file name into ``Cell In[3]``.
"""

from __future__ import annotations

import linecache
import re
import signal
from dataclasses import dataclass
from typing import Callable

from taas.io import keys

RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


@dataclass
class ProcessEnd:
    key: str
    returncode: int | None  # None: still running when the job was stopped
    seen_at: float  # when the supervisor saw it end
    record: dict | None = None  # its report (an error, or how it exited), if it wrote one
    fault: str = ""  # faulthandler's dump, if it died by a signal
    stopped: bool = False  # it ended after the supervisor began stopping the job

    @property
    def failed(self) -> bool:
        if self.record is not None and self.record.get("exit_code", 1) != 0:
            return True
        return self.returncode not in (0, None)

    @property
    def left(self) -> bool:
        """A rank that ended by itself with code 0 (finished, or sys.exit(0) / os._exit(0)).
        (A loader worker that is done exits 0 before the ranks: that is no cause.)"""
        return keys.is_rank(self.key) and self.returncode == 0 and not self.failed

    @property
    def failed_at(self) -> float:
        return self.record["time"] if self.record else self.seen_at


# A collective that fails because a peer died is a consequence, not a cause: when rank 1
# segfaults, rank 0's all_reduce raises "Read error" a moment later, often before the
# supervisor even sees rank 1's exit.
_PEER_LOST = re.compile(
    r"DistBackendError|Connection closed by peer|Connection reset by peer|Read error|"
    r"Broken pipe|ProcessGroupGloo|gloo/transport|NCCL communicator was aborted|"
    r"Socket Timeout|failed to recv, got 0 bytes"
)


def is_consequence(end: ProcessEnd) -> bool:
    """Did this process fail only because a peer went away?"""
    chain = (end.record or {}).get("chain") or []
    return bool(chain) and bool(_PEER_LOST.search(chain[-1]["text"]))


# Signals the supervisor never sends: a process that died of one died of its own fault, even
# when its exit was seen only after the stop began (a peer's lost-connection error can come
# first: the dying process's sockets close before it is reaped).
_FAULTS = {-int(s) for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)}


def _was_stopped(end: ProcessEnd) -> bool:
    """Killed by the supervisor's stop, with nothing of its own to say."""
    return end.stopped and end.record is None and end.returncode not in _FAULTS and not end.fault


def root_cause(ends: list[ProcessEnd]) -> ProcessEnd | None:
    """The earliest failure, preferring real causes over peers' lost-connection errors and
    processes the supervisor stopped; when only lost connections remain, the process that
    left first, else the one that died of a signal the stop does not send."""
    failed = [e for e in ends if e.failed]
    if not failed:
        return None
    real = [e for e in failed if not is_consequence(e) and not _was_stopped(e)]
    if real:
        return min(real, key=lambda e: e.failed_at)
    left = [e for e in ends if e.left]
    if left:
        return min(left, key=lambda e: e.failed_at)
    # Only lost connections: a peer went away.  One that died silently of a signal the stop
    # does not end ranks with (it sends SIGTERM) went away first, whenever its exit was seen.
    silent = [e for e in failed if e.record is None and (e.returncode or 0) < 0
              and e.returncode not in (-signal.SIGTERM, -signal.SIGINT)]
    if silent:
        return min(silent, key=lambda e: e.failed_at)
    causes = [e for e in failed if not _was_stopped(e)] or failed
    return min(causes, key=lambda e: e.failed_at)


def left_early(ends: list[ProcessEnd]) -> ProcessEnd | None:
    """The first process that left (code 0) while others were still running, if one did."""
    running = [e for e in ends if not e.left and keys.is_rank(e.key)]
    left = [e for e in ends if e.left and any(e.failed_at < r.failed_at for r in running)]
    return min(left, key=lambda e: e.failed_at) if left else None


def left_line(end: ProcessEnd) -> str:
    """One line for a process that left while the others were still running."""
    how = end.record["message"] if end.record and end.record.get("message") else "exited (code 0)"
    return f"{end.key} {how} while the other ranks were still running"


def describe_exit(end: ProcessEnd) -> str:
    code = end.returncode
    if code is None:
        return "was still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def summary(end: ProcessEnd) -> str:
    """One line: what went wrong in the root cause."""
    if end.left:
        return left_line(end)
    if end.record and end.record.get("message"):
        return f"{end.key} {end.record['message']}"
    if end.record and end.record.get("chain"):
        return f"{end.key} failed: {end.record['chain'][-1]['text'].splitlines()[-1]}"
    return f"{end.key} {describe_exit(end)}"


def render(root: ProcessEnd, others: list[ProcessEnd], name_for: Callable[[str], str] | None = None,
           color: bool = True) -> list[str]:
    """The lines a notebook shows for a failed job."""
    red, bold, reset = (RED, BOLD, RESET) if color else ("", "", "")
    lines = [f"{red}{bold}{summary(root)}{reset}"]
    chain = (root.record or {}).get("chain") or []
    for item in chain:
        if item.get("relation") == "cause":
            lines.append("\nThe above exception was the direct cause of the following exception:\n")
        elif item.get("relation") == "context":
            lines.append("\nDuring handling of the above exception, another exception occurred:\n")
        if item["frames"]:
            lines.append("Traceback (most recent call last):")
        for frame in item["frames"]:
            lines.append(_frame(frame, name_for))
        lines.append(f"{red}{item['text']}{reset}")
    hint = (root.record or {}).get("hint")
    if hint:  # e.g. why the working directory was read-only
        lines.append(hint)
    if not chain and root.fault.strip():
        lines.append(f"Python stack of {root.key} when it died (faulthandler):")
        lines.extend("  " + line for line in root.fault.strip().splitlines())
    if root.left:
        lines.append("A rank that ends while the others wait in a collective makes them fail: "
                     "every rank must make the same collective calls.")
    verb = "exited" if root.left else "failed"
    for end in sorted(others, key=lambda e: _order(e.key)):
        if (end.failed and end.returncode is not None and end.returncode > 0 and end.record
                and end.record["time"] <= root.failed_at and not is_consequence(end)):
            lines.append(f"{end.key}: also failed: {summary(end)}")
        elif (end.returncode is not None and end.returncode < 0 and end.record and end.record.get("message")
              and end.record["time"] <= root.failed_at):  # killed with the root cause (a lost node)
            lines.append(f"{end.key}: {summary(end).removeprefix(end.key + ' ')}")
        elif end.left and end.failed_at <= root.failed_at:
            lines.append(f"{end.key}: had already ended (code 0)")
        else:
            lines.append(f"{end.key}: stopped after {root.key} {verb}")
    return lines


def _frame(frame: dict, name_for: Callable[[str], str] | None) -> str:
    filename, lineno, name = frame["filename"], frame["lineno"], frame["name"]
    where = name_for(filename) if name_for else None
    head = f"  {where}, line {lineno}" if where else f'  File "{filename}", line {lineno}'
    if name != "<module>":
        head += f", in {name}"
    source = frame.get("line") or linecache.getline(filename, lineno or 0).strip()
    return head + (f"\n    {source}" if source else "")


def _order(key: str):
    return keys.order(key)


LAYER_SHOWN = 3  # files a layer hint names before "and N more"


def layer_hint(written: dict[str, list[str]]) -> str | None:
    """The one line for a job that failed after processes other than rank 0 wrote files under
    ``--storage layer`` (``written``: path -> the processes that wrote it): each wrote into a
    layer of its own, so no other rank saw those files while the job ran -- the usual reason
    why ranks coordinating through files fail ("Main process was not first").  None: nothing
    written (caches under ``__pycache__`` do not count)."""
    paths = sorted(p for p in written if "__pycache__" not in p.split("/"))
    if not paths:
        return None
    who = sorted({w for p in paths for w in written[p]}, key=_order)
    names = who[0] if len(who) == 1 else ", ".join(who[:-1]) + " and " + who[-1]
    files = ", ".join(paths[:LAYER_SHOWN]) + (
        f" and {len(paths) - LAYER_SHOWN} more" if len(paths) > LAYER_SHOWN else "")
    own = "a layer of its own" if len(who) == 1 else "layers of their own"
    return (f"taas: {names} wrote {files} into {own} (--storage layer, the default): the other "
            "ranks could not see these files while the job ran, only after it ended; for ranks "
            "that share files on purpose, run the cell with --storage shared")


def unseen_hint(written: list[str]) -> str | None:
    """The one line for a job that failed (or hung) while files were written in the working
    directory itself (by rank 0 or the notebook) under ``--storage layer``: a rank other than 0
    sees the working directory through an overlay, which remembers that a name was not there,
    so a file created after the rank first looked for it stays invisible to that rank until the
    job ends.  None: nothing written (``written``: relative paths)."""
    if not written:
        return None
    files = ", ".join(written[:LAYER_SHOWN]) + (
        f" and {len(written) - LAYER_SHOWN} more" if len(written) > LAYER_SHOWN else "")
    return (f"taas: {files} {'was' if len(written) == 1 else 'were'} written in the working "
            "directory while the job ran: a rank other than 0 (--storage layer, the default) does "
            "not see a file created there after it first looked for it; create such files before "
            "the cell, or run it with --storage shared")


def syntax_error(exc: SyntaxError, name_for: Callable[[str], str] | None = None):
    """The cell's SyntaxError as Python shows it, at the cell's own line, without taas's frames
    (a cell that does not compile fails before anything starts: no process, no report)."""
    import traceback

    from taas.errors import CellSyntaxError

    where = name_for(exc.filename) if name_for and exc.filename else None
    lines = "".join(traceback.format_exception_only(SyntaxError, exc)).rstrip("\n").splitlines()
    if where and lines and lines[0].lstrip().startswith("File "):
        lines[0] = f"  {where}, line {exc.lineno}"
    summary = f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return CellSyntaxError(summary, [RED + summary + RESET] + lines)
