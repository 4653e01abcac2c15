"""Every process's output, live in the cell: split into lines, tagged, filtered, progress in place.

Pure logic over bytes; where the text goes is a :class:`Sink` (a terminal, or the notebook via
the magics layer).

* :class:`LineSplitter` turns one stream's bytes into complete lines and *progress* states.
  Decoding is incremental (a UTF-8 character split across two reads stays whole).  A carriage
  return (tqdm) starts a new state of the same line: the latest state is a progress update,
  and the text that the newline finally ends is the line.
* :class:`OutputRouter` tags each line with its process (``[rank1] ``) when there is more than
  one, shows only the chosen ranks live (keeping the others' recent lines to replay if the job
  fails), and throttles progress updates.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from typing import Protocol


class LineSplitter:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> tuple[list[str], str | None]:
        """(complete lines, latest progress state or None) after ``data``."""
        text = self._pending + self._decoder.decode(data)
        *complete, self._pending = text.replace("\r\n", "\n").split("\n")
        lines = [_visible(line) for line in complete]
        progress = None
        if "\r" in self._pending:
            head, _, tail = self._pending.rpartition("\r")
            # While the newest state is still being written, show the last finished one.
            progress = tail if tail else _visible(head)
        return lines, progress

    def flush(self) -> list[str]:
        text = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return [_visible(text)] if text else []


def _visible(line: str) -> str:
    """What a terminal shows for a line containing carriage returns: its last state."""
    if "\r" not in line:
        return line
    states = [s for s in line.split("\r") if s]
    return states[-1] if states else ""


class Sink(Protocol):
    def write(self, stream: str, text: str) -> None:
        """Append ``text`` (whole lines, with newlines) to ``stream`` ('stdout'/'stderr')."""

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        """Show ``text`` as the in-place progress line of ``key``; ``final``: it is done."""


class OutputRouter:
    def __init__(self, sink: Sink, keys: list[str], show: set[str] | None, tag: bool,
                 keep: int = 200, progress_interval: float = 0.1):
        self.sink = sink
        self.show = show  # None: all
        self.tag = tag
        self.progress_interval = progress_interval
        self._splitters: dict[tuple[str, str], LineSplitter] = {}
        self._keep = keep
        self._held: dict[str, deque] = {k: deque(maxlen=keep) for k in keys}
        self._progress: dict[tuple[str, str], list] = {}  # (key, stream) -> [text, shown_at, dirty]

    def _prefix(self, key: str) -> str:
        return f"[{key}] " if self.tag else ""

    def visible(self, key: str) -> bool:
        return self.show is None or key in self.show

    def feed(self, key: str, stream: str, data: bytes) -> None:
        splitter = self._splitters.setdefault((key, stream), LineSplitter())
        lines, progress = splitter.feed(data)
        self._emit(key, stream, lines)
        if progress is not None and self.visible(key):
            state = self._progress.setdefault((key, stream), ["", 0.0, False])
            state[0], state[2] = progress, True
            self.tick()

    def _emit(self, key: str, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        prefix = self._prefix(key)
        if not self.visible(key):
            self._held.setdefault(key, deque(maxlen=self._keep)).extend((stream, line) for line in lines)
            return
        state = self._progress.pop((key, stream), None)
        if state is not None:  # the progress line is finished: it stays where it was shown
            self.sink.progress(key, stream, prefix + lines[0], final=True)
            lines = lines[1:]
        if lines:
            self.sink.write(stream, "".join(prefix + line + "\n" for line in lines))

    def tick(self) -> None:
        """Show throttled progress updates that are due."""
        now = time.monotonic()
        for (key, stream), state in self._progress.items():
            if state[2] and now - state[1] >= self.progress_interval:
                self.sink.progress(key, stream, self._prefix(key) + state[0], final=False)
                state[1], state[2] = now, False

    def close(self) -> None:
        """The processes are gone: print partial last lines, settle progress lines."""
        for (key, stream), splitter in self._splitters.items():
            self._emit(key, stream, splitter.flush())
        for (key, stream), state in list(self._progress.items()):
            self.sink.progress(key, stream, self._prefix(key) + state[0], final=True)
        self._progress.clear()

    def replay_hidden(self, header: str) -> None:
        """After a failure: show what the hidden ranks said lately."""
        for key, held in self._held.items():
            if held and not self.visible(key):
                self.sink.write("stderr", header.format(key=key) + "\n")
                prefix = self._prefix(key)
                for stream, line in held:
                    self.sink.write(stream, prefix + line + "\n")
                held.clear()


class TerminalSink:
    """Plain Python (no notebook): lines to sys.stdout/sys.stderr, progress with \\r."""

    def write(self, stream: str, text: str) -> None:
        import sys

        target = sys.stdout if stream == "stdout" else sys.stderr
        target.write(text)
        target.flush()

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        import sys

        sys.stderr.write("\r" + text + ("\n" if final else ""))
        sys.stderr.flush()
