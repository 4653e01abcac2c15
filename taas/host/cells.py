"""One cell in a job host, as values: what comes back, and a failure both ways.

A detached job's rank 0 names and Out[] are pickled one by one for its record (:func:`returned`:
one that cannot travel costs itself and a note).  Any host's exception is turned into what the
notebook would have shown (:func:`failure_of`, :class:`~taas.host.api.Failure`), and a kernel
raises it again from that (:func:`rebuilt`, :func:`failure_raised`).
"""

from __future__ import annotations

import logging
import pickle
import traceback

import cloudpickle

from taas.errors import JobFailed, LaunchError, RenderedError, TaasError
from taas.host.api import CellFailed, Failure, Returned

log = logging.getLogger(__name__)


def returned(result, sink) -> Returned:
    """Rank 0's names and Out[] (a CellResult) as a record keeps them, each pickled on its own
    (one that cannot be costs itself and a note, shown in ``sink``)."""
    from taas.session import WARN, write_note

    values, notes = {}, list(result.notes)
    for name, value in result.values.items():
        try:
            values[name] = cloudpickle.dumps(value)
        except Exception as exc:  # one value that cannot be kept costs itself, not the others
            notes.append(f"taas: `{name}` ({type(value).__name__}) could not be kept for the "
                         f"notebook: {exc}")
    out = None
    if result.has_out:
        try:
            out = cloudpickle.dumps(result.out)
        except Exception as exc:  # the same for Out[]
            notes.append(f"taas: Out[] ({type(result.out).__name__}) could not be kept: {exc}")
    for line in notes:
        write_note(sink, line, WARN)
    return Returned(values, out, result.has_out and out is not None, tuple(notes))


def cell_sources() -> dict:
    """The notebook's cells as linecache holds them (entries with no file behind them): what a
    host's tracebacks and stacks quote the cells' lines from."""
    import linecache

    return {name: entry for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None}


def failure_of(exc: BaseException) -> Failure:
    """What the notebook shows for ``exc``, the cell's exception."""
    if isinstance(exc, KeyboardInterrupt):
        render = getattr(exc, "_render_traceback_", None)
        lines = tuple(render()) if callable(render) else ("KeyboardInterrupt",)
        return Failure(lines[0] if lines else "KeyboardInterrupt", lines, "KeyboardInterrupt")
    if isinstance(exc, RenderedError):
        return Failure(exc.summary, tuple(exc.rendered), type(exc).__name__)
    if isinstance(exc, TaasError):
        return Failure(str(exc), (), type(exc).__name__)
    lines = traceback.format_exception(exc)
    return Failure(f"{type(exc).__name__}: {exc}", tuple(lines), type(exc).__name__)


def cause_of(exc: BaseException) -> str:
    """A failed job's cause in one line, for its record."""
    if isinstance(exc, JobFailed):
        return exc.summary
    if isinstance(exc, RenderedError):
        return exc.summary.splitlines()[0] if exc.summary else type(exc).__name__
    if isinstance(exc, TaasError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def rebuilt(failure: CellFailed, report_body: bytes) -> BaseException:
    """The exception the host's supervisor raised, as the notebook shows it."""
    from taas import errors

    kind = getattr(errors, failure.error, None)
    if failure.error == "KeyboardInterrupt" or kind is None or not isinstance(kind, type):
        return failure_raised(failure)
    if issubclass(kind, errors.KeptRanksGone):
        return kind(failure.summary.removeprefix("the kept ranks are gone: "))
    if issubclass(kind, errors.JobFailed):
        try:
            report = pickle.loads(report_body) if report_body else None
        except Exception:  # a report that cannot be read: the rendering says it all
            report = None
        return kind(failure.summary, list(failure.rendered) or None, report)
    if issubclass(kind, RenderedError):
        return kind(failure.summary, list(failure.rendered) or None)
    try:
        return kind(failure.summary)
    except TypeError:
        return failure_raised(failure)


def failure_raised(message: CellFailed) -> BaseException:
    """The cell's exception as the notebook shows it."""
    if message.error == "KeyboardInterrupt":
        exc = KeyboardInterrupt()
        lines = list(message.rendered)
        exc._render_traceback_ = lambda: list(lines)  # type: ignore[attr-defined]
        if len(lines) > 1:
            exc.add_note("\n".join(lines[1:]))
        return exc
    if message.error in ("JobFailed", "CellSyntaxError") or message.rendered:
        return JobFailed(message.summary, list(message.rendered) or None)
    return LaunchError(message.summary)
