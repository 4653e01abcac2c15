"""Where are the ranks, and why did the job fail?  What the supervisor tells the user.

* :func:`places`: every rank's place (cell line and call, its stack, or how it had already
  ended), asked of the running ranks through the launcher's stack requests
  (:mod:`taas.launch.process.stacks`); used past ``--timeout``, on Ctrl-C and after ``--stall``
  seconds of silence (:func:`stall_line`, :func:`timed_out`, :func:`explain_interrupt`).
* :func:`job_failed`: the failure report -- every process's report file and fault dump, read
  through the launcher's :class:`~taas.launch.api.JobHandle`, the root cause first.
* :func:`layer_hint`: after an attempt that did not succeed, the files ranks other than 0 wrote
  into their ``--storage layer`` layers, which the others could not see meanwhile;
  :func:`missing_file`: whether the root cause was a file that was not there (then the files
  written in the working directory meanwhile are named: :func:`taas.io.failure.unseen_hint`).

The rendering itself is :mod:`taas.io.hang` and :mod:`taas.io.failure` (pure); this module
fetches what they render.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from taas.errors import JobFailed
from taas.io import failure, hang
from taas.launch.api import error_name, fault_name
from taas.supervisor.events import Stack

log = logging.getLogger(__name__)

STACK_WAIT = 2.0  # seconds to wait for the ranks' stacks (taas.launch.process.stacks) before going on


def places(handle, ranks: list[str], ends: dict, answers: dict[str, Stack],
           pump: Callable[[], None]) -> list[hang.Place]:
    """Where every rank in ``ranks`` is: the running ones are asked for their stacks, the
    others ended.  ``answers`` is where the caller's event reader puts each ``stack`` message
    (emptied first); ``pump`` reads events for a moment, so output keeps flowing meanwhile.
    Answers are awaited up to STACK_WAIT s."""
    answers.clear()
    asked = set(handle.request_stacks([k for k in ranks if k not in ends]))
    deadline = time.monotonic() + STACK_WAIT
    while asked - set(answers) - set(ends) and time.monotonic() < deadline:
        pump()
    return [place(k, answers.get(k), ends.get(k), handle) for k in ranks]


def place(key: str, answer: Stack | None, end: failure.ProcessEnd | None, handle) -> hang.Place:
    """One rank's place: its answer, how it ended, or neither (it did not answer)."""
    if answer is not None:
        return hang.Place(key, answer.line, answer.call, list(answer.frames), debugger=answer.debugger)
    if end is None:
        return hang.Place(key)
    if end.returncode == 0:
        record = read_report(handle, key)
        return hang.Place(key, ended="already ended (sys.exit(0))" if record else "already ended (code 0)")
    return hang.Place(key, ended=f"already ended ({failure.describe_exit(end)})")


def stall_line(stall: float, where: list[hang.Place]) -> str:
    return f"taas: no output for {stall:g} s; {hang.one_line(where)}\n"


def timed_out(timeout: float, ends: list[failure.ProcessEnd], where: list[hang.Place],
              name_for=None) -> JobFailed:
    """The error of a job stopped past ``--timeout``: why (a process that left early, or the
    rank that is not where the others are) and where every rank was."""
    left = failure.left_early(ends)
    odd = hang.odd_sentence(where)
    why = f" ({failure.left_line(left)})" if left is not None else f" ({odd})" if odd else ""
    summary = f"the job ran past --timeout {timeout:g}s{why}; all its processes were stopped"
    return JobFailed(summary, [failure.RED + failure.BOLD + summary + failure.RESET]
                     + hang.render(where, name_for))


def explain_interrupt(exc: KeyboardInterrupt, where: list[hang.Place], name_for) -> None:
    """Make the notebook show where the ranks were when the job was interrupted: IPython
    shows an exception's ``_render_traceback_`` instead of its frames (the error's name stays
    KeyboardInterrupt); plain Python shows the note."""
    lines = ["KeyboardInterrupt: the job was interrupted; all its processes were stopped"]
    lines += hang.render(where, name_for)
    exc._render_traceback_ = lambda: list(lines)  # type: ignore[attr-defined]
    exc.add_note("\n".join(lines[1:]))


# -- failure reports ---------------------------------------------------------------------------
def read_report(handle, key: str) -> dict | None:
    """Process ``key``'s failure report (:mod:`taas.launch.process.report`), or None when it
    wrote none or it cannot be read (the report is only evidence: a bad one is no report)."""
    data = handle.fetch(key, error_name(key))
    if not data:
        return None
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        log.warning("ignored %s's failure report: not JSON", key)
        return None
    if not isinstance(record, dict):
        log.warning("ignored %s's failure report: not an object", key)
        return None
    return record


def job_failed(handle, ends: list[failure.ProcessEnd], name_for) -> JobFailed:
    """The failure report: every process's error file and fault dump, the root cause first.
    Called only for an attempt in which some process failed, so there is a root cause."""
    for end in ends:
        end.record = read_report(handle, end.key)
        end.fault = (handle.fetch(end.key, fault_name(end.key)) or b"").decode(errors="replace")
    root = failure.root_cause(ends)
    assert root is not None, "job_failed() of an attempt that did not fail"
    others = [end for end in ends if end is not root]
    return JobFailed(failure.summary(root), failure.render(root, others, name_for), root)


def missing_file(failed: JobFailed) -> bool:
    """Did the root cause fail on a file that was not there (FileNotFoundError)?"""
    chain = ((failed.report.record if failed.report is not None else None) or {}).get("chain") or []
    return bool(chain) and "No such file or directory" in chain[-1].get("text", "")


def layer_hint(report) -> str | None:
    """The layer hint (:func:`taas.io.failure.layer_hint`) for an attempt that did not succeed,
    from its merge report (:class:`taas.workdir.merge.MergeReport`, None: no layers): the files
    that reached the working directory or were set aside, i.e. that differed from what the other
    ranks saw there (a file written identically to the working directory's changes nothing)."""
    if report is None:
        return None
    differed = set(report.applied) | set(report.conflicts)
    return failure.layer_hint({p: w for p, w in report.written.items() if p in differed})
