"""The live rank panel's table: rows of figures -> text and HTML (pure).

A row per rank, or, when there are more than :data:`GROUP_OVER` ranks, a row per node with
its ranks' states counted (``running 6, waiting 2``) and their figures aggregated; then a row
per loader worker.  :class:`taas.io.board.Board` keeps the rows up to date while a job runs
and decides when the cell shows them; here they only become text (a terminal, nbconvert) or
an HTML table (a notebook that updates a display in place).

    rank   state    line  call        quiet   CPU    RSS     GPU mem  GPU
    rank0  running  7     train_step  0.3 s   99%    812 MB
    rank1  waiting  9     all_reduce  4.1 s   0%     790 MB

Columns: the state (starting, running, waiting -- in a torch.distributed call or for data --,
debugger -- at pdb's prompt --, input -- at ``input()`` --, done, failed, stopped), the cell
line the rank is at and the function it is in, seconds since its last output, CPU % and
resident memory; GPU memory and utilisation only when some rank has them (CUDA).  A blank
cell is a figure not known (yet).
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

GROUP_OVER = 16  # more ranks than this: one row per node
STATES = ("starting", "running", "waiting", "debugger", "input", "done", "failed", "stopped")  # the order counts show


@dataclass(frozen=True)
class RankRow:
    key: str  # rank0, ...
    state: str  # one of STATES
    node: int | None = None  # GROUP_RANK (None: not known yet)
    line: int | None = None  # the cell line it is at
    call: str = ""
    quiet: float | None = None  # seconds since its last output (None: nothing yet)
    cpu: float | None = None  # %
    rss: int | None = None  # bytes
    gpu_mem: int | None = None  # bytes
    gpu_util: int | None = None  # %


@dataclass(frozen=True)
class LoaderRow:
    key: str  # loader:NAME:W
    state: str  # loading | done | failed | stopped
    units: int  # units it produced so far
    wait: float | None = None  # share of the ranks' time spent waiting for this loader


@dataclass(frozen=True)
class NodeRow:
    node: int | None
    ranks: tuple[RankRow, ...]


# -- figures as text ------------------------------------------------------------------------
def size(nbytes: int | None) -> str:
    if nbytes is None:
        return ""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}" if nbytes < 10 * scale else f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def seconds(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}%"


def lines(values) -> str:
    """The cell lines of a node's ranks: ``7``, ``7, 9``, or ``7-12`` for many."""
    known = sorted({v for v in values if v is not None})
    if len(known) <= 3:
        return ", ".join(map(str, known))
    return f"{known[0]}-{known[-1]}"


def counts(states) -> str:
    """``running 6, waiting 2`` in the order of :data:`STATES`."""
    seen = Counter(states)
    return ", ".join(f"{s} {seen[s]}" for s in STATES if seen[s])


# -- the table ------------------------------------------------------------------------------
def grouped(ranks: list[RankRow]) -> Sequence[RankRow | NodeRow]:
    """The ranks as rows: one each, or one per node when there are more than GROUP_OVER."""
    if len(ranks) <= GROUP_OVER:
        return ranks
    nodes: dict[int | None, list[RankRow]] = {}
    for row in ranks:
        nodes.setdefault(row.node, []).append(row)
    order = sorted(nodes, key=lambda n: (n is None, n or 0))
    return [NodeRow(node, tuple(nodes[node])) for node in order]


def _gpu(ranks: list[RankRow]) -> bool:
    return any(r.gpu_mem is not None or r.gpu_util is not None for r in ranks)


def _rank_cells(row: RankRow, gpu: bool) -> list[str]:
    cells = [row.key, row.state, "" if row.line is None else str(row.line), row.call,
             seconds(row.quiet), percent(row.cpu), size(row.rss)]
    return cells + [size(row.gpu_mem), percent(row.gpu_util)] if gpu else cells


def _node_cells(row: NodeRow, gpu: bool) -> list[str]:
    ranks = row.ranks
    name = f"node{row.node}" if row.node is not None else "node ?"
    calls = Counter(r.call for r in ranks if r.call)
    call = calls.most_common(1)[0][0] + (" …" if len(calls) > 1 else "") if calls else ""
    quiet = [r.quiet for r in ranks if r.quiet is not None]
    cpu = [r.cpu for r in ranks if r.cpu is not None]
    util = [r.gpu_util for r in ranks if r.gpu_util is not None]

    def total(values):
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    cells = [f"{name} ({len(ranks)} ranks)", counts(r.state for r in ranks),
             lines(r.line for r in ranks), call,
             seconds(max(quiet)) if quiet else "",  # the quietest rank is the one to look at
             percent(sum(cpu) / len(cpu)) if cpu else "", size(total(r.rss for r in ranks))]
    if gpu:
        cells += [size(total(r.gpu_mem for r in ranks)), percent(sum(util) / len(util)) if util else ""]
    return cells


Cells = list[list[str]]


def table(ranks: list[RankRow], loaders: Sequence[LoaderRow] = ()) -> tuple[list[str], Cells, Cells]:
    """(header, rank or node rows, loader rows) as cells of text."""
    gpu = _gpu(ranks)
    rows = grouped(ranks)
    header = ["node" if rows and isinstance(rows[0], NodeRow) else "rank", "state", "line",
              "call", "quiet", "CPU", "RSS"] + (["GPU mem", "GPU"] if gpu else [])
    body = [_node_cells(r, gpu) if isinstance(r, NodeRow) else _rank_cells(r, gpu) for r in rows]
    tail = [[r.key, r.state, f"{r.units} units",
             "" if r.wait is None else f"data wait {percent(100 * r.wait)}"] for r in loaders]
    return header, body, tail


def text(title: str, ranks: list[RankRow], loaders: Sequence[LoaderRow] = ()) -> str:
    """The panel as plain text: the title, then aligned columns (a terminal, nbconvert)."""
    header, body, tail = table(ranks, loaders)
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]

    def aligned(row):
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()

    out = [title, aligned(header)] + [aligned(row) for row in body]
    if tail:
        loader_widths = [max(len(row[i]) for row in tail) for i in range(len(tail[0]))]
        out += ["  ".join(c.ljust(w) for c, w in zip(row, loader_widths)).rstrip() for row in tail]
    return "\n".join(out) + "\n"


_FONT = "font-family: var(--jp-code-font-family, monospace); font-size: 12px"
_STYLE = _FONT + "; border-collapse: collapse"
_CELL = "padding: 1px 8px; text-align: left; white-space: nowrap"
_COLOURS = {"failed": "#c62828", "waiting": "#b26a00", "debugger": "#1565c0", "input": "#1565c0",
            "done": "#2e7d32", "stopped": "#757575"}


def _html_row(cells: list[str], tag: str = "td", state: str | None = None) -> str:
    out = []
    for i, cell in enumerate(cells):
        style = _CELL
        if i == 1 and state in _COLOURS:
            style += f"; color: {_COLOURS[state]}"
        out.append(f'<{tag} style="{style}">{html.escape(cell)}</{tag}>')
    return "<tr>" + "".join(out) + "</tr>"


def as_html(title: str, ranks: list[RankRow], loaders: Sequence[LoaderRow] = ()) -> str:
    """The panel as an HTML table (a notebook's display, updated in place)."""
    header, body, tail = table(ranks, loaders)
    rows = grouped(ranks)
    states = [r.state if isinstance(r, RankRow) else None for r in rows]
    parts = [f'<div class="taas-panel" style="{_FONT}">',
             # The cells' own padding: the title lines up with the table and with the
             # cell's text outputs above and below (Lab pads those by as much).
             f'<div style="{_CELL}">{html.escape(title)}</div>',
             f'<table style="{_STYLE}">', _html_row(header, "th")]
    parts += [_html_row(cells, state=state) for cells, state in zip(body, states)]
    parts += [_html_row(cells + [""] * (len(header) - len(cells)), state=r.state)
              for cells, r in zip(tail, loaders)]
    parts.append("</table></div>")
    return "".join(parts)


def summary(world: int, elapsed: float, ranks: list[RankRow]) -> str:
    """The one line the panel gives way to when the job ends."""
    plural = "s" * (world != 1)
    return f"taas: {world} rank{plural}, {seconds(elapsed)}: {counts(r.state for r in ranks)}"
