"""Every process's output, live in the cell: split into lines, tagged, filtered, progress in place.

Pure logic over bytes; where the text goes is a :class:`Sink` (a terminal, or the notebook via
the magics layer).

* :class:`LineSplitter` (:mod:`taas.io.lines`) turns one stream's bytes into *pieces* of lines
  and *progress* states, in time linear in the bytes fed.
* :class:`OutputRouter` tags each line with its process (``[rank1] ``, once per line however
  many pieces it comes in; another process's line in between ends it visually) when there is
  more than one, shows only the chosen ranks live
  (keeping the others' recent pieces to replay if the job fails), and throttles progress updates.
  The ranks' whole lines go through :mod:`taas.io.collapse`: a line several ranks print
  identically shows once, tagged with those ranks (``[rank0-31] epoch done``), and another
  rank's progress bar that looks like the lead rank's merges into it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from taas.io import collapse
from taas.io import keys as names

from taas.io.lines import MAX_LINE, LineSplitter  # noqa: F401 (re-exported: the router's input)


class Sink(Protocol):
    def write(self, stream: str, text: str) -> None:
        """Append ``text`` (whole lines, with newlines) to ``stream`` ('stdout'/'stderr')."""

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        """Show ``text`` as the in-place progress line of ``key``; ``final``: it is done."""


# taas's own notes, and which stream each goes to -- the one rule, and :func:`note` the one way to
# write one.  Every note is one line starting "taas: ", so that it reads apart from the ranks'
# lines (tagged "[rankN] " when there is more than one rank).  INFO notes say what taas did for
# the user, with nothing wrong and nothing to do (the CPU fallback, a loader's summary,
# DataParallel run as DDP): they go to the cell's stdout, which JupyterLab does not paint red.
# WARN notes say that something did not go as the cell asked, or ask the user to act (ranks that
# trained but never communicated, a value not brought back, a loader rebound, big values
# pickled for lack of room, merged layers' conflicts, the layer hint on failure, restarts,
# stalls): they go to stderr with the ranks' errors.  (taas.workdir.merge, which may not import
# this room, writes its WARN notes to stderr itself; a rank writes its own with print.)
INFO = "stdout"
WARN = "stderr"


def note(sink: Sink | None, line: str, level: str = INFO) -> None:
    """Write taas's own note ``line`` (one line, "taas: ..."; a trailing newline is added) to
    ``sink`` (None: the terminal) on the stream of ``level``, :data:`INFO` or :data:`WARN`."""
    (sink or TerminalSink()).write(level, line.rstrip("\n") + "\n")


@dataclass(eq=False)
class _Bar:
    """One process's open progress line, as the router shows it."""

    born: float  # when it began: another rank's bar waits a moment for rank 0's to match
    text: str = ""  # the state shown last
    at: float = 0.0  # when
    dirty: bool = True  # it changed since
    shown: bool = False  # it has a display of its own
    merged: bool = False  # it matched the lead rank's bar and shows as part of it


@dataclass(eq=False)
class _LeadBar:
    """The lead rank's latest progress line on a stream and the ranks whose bars merged in."""

    shape: tuple
    ranks: set = field(default_factory=set)
    open: bool = True


class OutputRouter:
    """Routes every process's output to ``sink`` (see the module's docstring).

    With ``tag`` (more than one process), the ranks' whole lines go through a
    :class:`~taas.io.collapse.Collapser`: a line several ranks print identically shows once,
    tagged with those ranks; held lines are shown by :meth:`tick` (called periodically, with
    the time from ``clock``) and by :meth:`close`.  Another rank's progress bar that matches the
    lead rank's (the lowest rank shown) merges into it."""

    def __init__(self, sink: Sink, keys: list[str], show: set[str] | None, tag: bool,
                 keep: int = 200, progress_interval: float = 0.1, hold: float = collapse.HOLD,
                 clock: Callable[[], float] = time.monotonic):
        self.sink = sink
        self.show = show  # None: all
        self.tag = tag
        self.progress_interval = progress_interval
        self.hold = hold
        self._clock = clock
        self._splitters: dict[tuple[str, str], LineSplitter] = {}
        self._keep = keep
        self._held: dict[str, deque] = {k: deque(maxlen=keep) for k in keys}
        self._progress: dict[tuple[str, str], _Bar] = {}
        self._mid_line: set[tuple[str, str]] = set()  # a piece of a long line was shown
        ranks = [r for r in (names.rank_of(k) for k in keys if self.visible(k)) if r is not None]
        self._lead = min(ranks) if ranks else None
        # One rank shown (--show 0): nothing to collapse, nothing to wait for.
        self._collapse = collapse.Collapser(ranks, hold) if tag and len(ranks) > 1 else None
        self._lead_bars: dict[str, _LeadBar] = {}  # stream -> the lead rank's latest bar

    def _prefix(self, key: str) -> str:
        return f"[{key}] " if self.tag else ""

    def visible(self, key: str) -> bool:
        return self.show is None or key in self.show

    def _rank(self, key: str) -> int | None:
        """The rank whose lines collapse with the others', None for a line shown as it is."""
        return names.rank_of(key) if self._collapse is not None else None

    def feed(self, key: str, stream: str, data: bytes) -> None:
        splitter = self._splitters.setdefault((key, stream), LineSplitter())
        pieces, progress = splitter.feed(data)
        self._emit(key, stream, pieces)
        if progress and self.visible(key):
            bar = self._progress.get((key, stream))
            if bar is None:
                bar = self._progress[(key, stream)] = _Bar(born=self._clock())
            bar.dirty = True
            self._bars_due(self._clock())

    def _emit(self, key: str, stream: str, pieces: list[str]) -> None:
        if not pieces:
            return
        if not self.visible(key):
            self._held.setdefault(key, deque(maxlen=self._keep)).extend((stream, p) for p in pieces)
            return
        bar = self._progress.pop((key, stream), None)
        if bar is not None:  # the progress line is finished: it stays where it was shown
            first = pieces[0]
            if first.endswith("\n"):
                pieces = pieces[1:]
                if self._bar_end(key, stream, bar, first[:-1]):
                    pieces = [first] + pieces  # a bar never shown ends as a line
            else:  # it grew too long to be a progress line: it goes on as text
                self._bar_end(key, stream, bar, bar.text)
        if pieces:
            self._lines(key, stream, pieces)

    def _lines(self, key: str, stream: str, pieces: list[str]) -> None:
        rank = self._rank(key)
        if rank is None:
            self.sink.write(stream, self._tagged(key, stream, pieces, self._mid_line))
            return
        assert self._collapse is not None
        out: list[tuple[str, str]] = []
        now, lines = self._clock(), list[str]()
        for piece in pieces:
            if (key, stream) in self._mid_line or not piece.endswith("\n"):
                # A piece of a long line is shown as it comes, after this rank's held lines.
                out += self._texts(self._collapse.extend(rank, stream, lines, now))
                out += self._texts(self._collapse.through(rank))
                out.append((stream, self._tagged(key, stream, [piece], self._mid_line)))
                lines = []
            else:
                lines.append(piece)
        out += self._texts(self._collapse.extend(rank, stream, lines, now))
        self._write(out)

    def _texts(self, shown: list[collapse.Shown]) -> list[tuple[str, str]]:
        """Collapsed lines as (stream, text), each tagged with its ranks.  A long line left
        open on that stream is ended first, as :meth:`_tagged` does."""
        out = []
        for line in shown:
            open_lines = [m for m in self._mid_line if m[1] == line.stream]
            if open_lines:
                self._mid_line.difference_update(open_lines)
            out.append((line.stream, "\n" * bool(open_lines)
                        + f"[rank{collapse.tag(line.ranks)}] " + line.text))
        return out

    def _write(self, out: list[tuple[str, str]]) -> None:
        """One write per run of lines on the same stream (the notebook gets few, large writes)."""
        i = 0
        while i < len(out):
            j = i
            while j < len(out) and out[j][0] == out[i][0]:
                j += 1
            self.sink.write(out[i][0], "".join(text for _, text in out[i:j]))
            i = j

    def _tagged(self, key: str, stream: str, pieces, mid_line: set) -> str:
        """``pieces`` as text, the process's tag at the start of each line (not of a piece that
        continues one).  A piece of another process's line in between ends the open line
        (what follows of it is tagged again), so that lines of two processes never mix."""
        prefix = self._prefix(key)
        if not prefix:
            return "".join(pieces)
        out = []
        others = [m for m in mid_line if m[1] == stream and m[0] != key]
        if others:  # another process's long line is open: end it here, it goes on tagged again
            out.append("\n")
            mid_line.difference_update(others)
        for piece in pieces:
            out.append(piece if (key, stream) in mid_line else prefix + piece)
            if piece.endswith("\n"):
                mid_line.discard((key, stream))
            else:
                mid_line.add((key, stream))
        return "".join(out)

    # -- progress lines ---------------------------------------------------------------------
    def _bar_prefix(self, key: str, stream: str) -> str:
        lead = self._lead_bars.get(stream)
        rank = self._rank(key)
        if rank is not None and rank == self._lead and lead is not None:
            return f"[rank{collapse.tag(lead.ranks)}] "
        return self._prefix(key)

    def _merges(self, key: str, stream: str, bar: _Bar, text: str) -> bool:
        """Whether ``key``'s bar (another rank than the lead) is shown as part of the lead's:
        decided before it is shown, when it looks like the lead's latest bar."""
        if bar.merged or bar.shown:
            return bar.merged
        lead = self._lead_bars.get(stream)
        if lead is None or lead.shape != collapse.bar_shape(text):
            return False
        bar.merged = True
        rank = self._rank(key)
        lead.ranks.add(rank)
        lead_bar = self._progress.get((names.rank_key(self._lead), stream)) if self._lead is not None else None
        if lead_bar is not None and lead.open:
            lead_bar.dirty = True  # its tag now names one more rank
        return True

    def _show_bar(self, key: str, stream: str, bar: _Bar, text: str, final: bool) -> None:
        rank = self._rank(key)
        if rank is not None and not bar.shown and self._collapse is not None:
            self._write(self._texts(self._collapse.through(rank)))
        if rank is not None and rank == self._lead:
            lead = self._lead_bars.get(stream)
            if lead is None or not bar.shown:  # a new bar of the lead rank
                lead = self._lead_bars[stream] = _LeadBar(collapse.bar_shape(text), {rank})
            lead.shape, lead.open = collapse.bar_shape(text), not final
        bar.text, bar.shown = text, True
        self.sink.progress(key, stream, self._bar_prefix(key, stream) + text, final=final)

    def _bar_end(self, key: str, stream: str, bar: _Bar, text: str) -> bool:
        """``key``'s progress line ended as ``text``.  True: it was never shown (another rank's
        bar, still waiting to match the lead's) and does not match: it goes on as a line."""
        rank = self._rank(key)
        if rank is not None and rank != self._lead and self._merges(key, stream, bar, text):
            return False
        if rank is not None and rank != self._lead and not bar.shown:
            return True
        self._show_bar(key, stream, bar, text, final=True)
        return False

    def tick(self) -> None:
        """After each round of reads: show held lines whose time is up and throttled progress
        updates that are due."""
        now = self._clock()
        if self._collapse is not None:
            self._write(self._texts(self._collapse.due(now)))
        self._bars_due(now)

    def _bars_due(self, now: float) -> None:
        for (key, stream), bar in list(self._progress.items()):
            if not bar.dirty or now - bar.at < self.progress_interval:
                continue
            text = self._splitters[(key, stream)].progress_text()
            rank = self._rank(key)
            if rank is not None and rank != self._lead:
                if self._merges(key, stream, bar, text):
                    bar.dirty = False
                    continue
                if not bar.shown and now - bar.born < self.hold:
                    continue  # the lead's bar may yet come and match it
            self._show_bar(key, stream, bar, text, final=False)
            bar.at, bar.dirty = now, False

    def flush(self) -> None:
        """Show every whole line held back now (lines several ranks may yet print alike):
        before the notebook's input box opens, the cell shows what came before the question."""
        if self._collapse is not None:
            self._write(self._texts(self._collapse.flush()))

    def close(self) -> None:
        """The processes are gone: print partial last lines, settle progress lines."""
        for (key, stream), splitter in self._splitters.items():
            if (key, stream) in self._progress:
                self._progress[(key, stream)].text = splitter.progress_text()
            self._emit(key, stream, splitter.flush())
        for (key, stream), bar in list(self._progress.items()):
            if self._bar_end(key, stream, bar, bar.text):
                self._lines(key, stream, [bar.text + "\n"])
        self._progress.clear()
        if self._collapse is not None:
            self._write(self._texts(self._collapse.flush()))

    def replay_hidden(self, header: str) -> None:
        """After a failure: show what the hidden ranks said lately."""
        mid_line: set = set()
        for key, held in self._held.items():
            if held and not self.visible(key):
                self.sink.write("stderr", header.format(key=key) + "\n")
                for stream, piece in held:
                    self.sink.write(stream, self._tagged(key, stream, [piece], mid_line))
                held.clear()


class Recording:
    """A Sink that shows everything in ``sink`` and keeps what was written (``lines``, as
    ``(stream, text)``): a detached job's notes from its preparation, for its record."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.lines: list[tuple[str, str]] = []

    def write(self, stream: str, text: str) -> None:
        self.lines.append((stream, text))
        self.sink.write(stream, text)

    def __getattr__(self, name: str):
        return getattr(self.sink, name)


class TerminalSink:
    """Plain Python (no notebook): lines to sys.stdout/sys.stderr, progress with \\r."""

    def write(self, stream: str, text: str) -> None:
        import sys

        target = sys.stdout if stream == "stdout" else sys.stderr
        target.write(text)
        target.flush()

    def ask(self, prompt: str, password: bool = False) -> str:
        """A rank's ``input()`` or pdb prompt, read from this process's stdin (a terminal's
        IPython, a script): EOFError at its end."""
        import getpass
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        return getpass.getpass(prompt) if password else input(prompt)

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        import sys

        sys.stderr.write("\r" + text + ("\n" if final else ""))
        sys.stderr.flush()
