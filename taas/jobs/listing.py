"""``taas jobs`` / ``%taas jobs``: the records as a table (pure: records and a clock in, text out)."""

from __future__ import annotations

import time

from taas.io.panel import size
from taas.jobs.api import Listed, State


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def render(items: list[Listed], now: float | None = None) -> str:
    """One line per job, newest first, then the failed jobs' causes; a line when there are none."""
    if not items:
        return "taas: no jobs (a cell run with --detach starts one)"
    now = time.time() if now is None else now
    rows = [("ID", "STATE", "RANKS", "WHERE", "STARTED", "TIME", "SIZE", "NOTEBOOK", "CELL")]
    notes = []
    for item in items:
        record = item.record
        if item.problem:
            rows.append((record.id, "unreadable", "", "", "", "", size(item.size), "", ""))
            notes.append(f"{record.id}: {item.problem}")
            continue
        end = record.ended if record.ended is not None and record.state.final else now
        state = record.state.value
        if record.state in (State.DONE, State.KEPT) and record.has_results and record.taken is None:
            state += " (results waiting)"
        rows.append((record.id, state, str(record.ranks or ""), record.where,
                     time.strftime("%m-%d %H:%M", time.localtime(record.started)),
                     duration(end - record.started), size(item.size),
                     _short(record.notebook, 24), _short(record.first_line, 40)))
        if record.state in (State.FAILED, State.LOST) and record.cause:
            notes.append(f"{record.id} {record.state.value}: {_short(record.cause, 160)}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + notes)


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def default_job(items: list[Listed], notebook: str) -> str | None:
    """The job ``attach`` with no id means (``items`` newest first): the newest running job of
    ``notebook``, else the newest running job, else the newest whose results wait; None."""
    readable = [item.record for item in items if not item.problem]
    for wanted in (lambda r: not r.state.final and notebook and r.notebook == notebook,
                   lambda r: not r.state.final,
                   lambda r: r.has_results and r.taken is None):
        for record in readable:
            if wanted(record):
                return record.id
    return None
