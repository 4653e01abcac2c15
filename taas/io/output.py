"""Every process's output, live in the cell: split into lines, tagged, filtered, progress in place.

Pure logic over bytes; where the text goes is a :class:`Sink` (a terminal, or the notebook via
the magics layer).

* :class:`LineSplitter` turns one stream's bytes into *pieces* of lines and *progress* states.
  Decoding is incremental (a UTF-8 character split across two reads stays whole).  A carriage
  return (tqdm) starts a new state of the same line: the latest state is a progress update,
  and the text that the newline finally ends is the line.  Its cost is linear in the bytes fed:
  only new data is searched for newlines, a line is kept as a list of chunks, a progress line
  keeps only its latest states, and a line longer than ``max_line`` characters is passed on in
  pieces, each as soon as ``max_line`` characters of it have come (so that 50 MB printed
  without a newline neither waits for the end of the job nor costs time quadratic in its
  length).
* :class:`OutputRouter` tags each line with its process (``[rank1] ``, once per line however
  many pieces it comes in; another process's line in between ends it visually) when there is
  more than one, shows only the chosen ranks live
  (keeping the others' recent pieces to replay if the job fails), and throttles progress updates.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from typing import Protocol

MAX_LINE = 1 << 20  # characters of one line kept before they are passed on as a piece


class LineSplitter:
    """One stream's bytes -> pieces of lines.

    :meth:`feed` returns ``(pieces, progress)``: each piece is text to show; a piece that ends
    a line ends with ``'\\n'``, a piece without it is the start of a line longer than
    ``max_line`` (None: no limit, pieces are whole lines).  ``progress`` is True when the
    current line is a progress line (it had a ``'\\r'``) whose state changed; its text is
    :meth:`progress_text` (asked for lazily: a caller that throttles updates pays only for the
    updates it shows).
    """

    def __init__(self, max_line: int | None = MAX_LINE) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._max = max_line
        self._parts: list[str] = []  # the current state of the open line, in chunks
        self._size = 0  # characters in _parts
        self._done = ""  # the latest finished non-empty state of the open line (before a '\r')
        self._cr = False  # the open line had a '\r': it is a progress line

    def feed(self, data: bytes) -> tuple[list[str], bool]:
        """(pieces, progress changed) after ``data``."""
        return self._take(self._decoder.decode(data))

    def flush(self) -> list[str]:
        """The stream ended: what is left, the open line ended with ``'\\n'``."""
        pieces, _ = self._take(self._decoder.decode(b"", final=True))
        if self._parts or self._cr:
            pieces.append(self._end_line())
        return pieces

    def progress_text(self) -> str:
        """The open progress line as a terminal shows it while it is being written: the state
        being written, or the last finished one while the new one is still empty."""
        return "".join(self._parts) if self._parts else self._done

    def _take(self, text: str) -> tuple[list[str], bool]:
        if "\r\n" in text:
            text = text.replace("\r\n", "\n")
        pieces: list[str] = []
        progress = False
        start = 0
        while True:
            end = text.find("\n", start)
            stop = len(text) if end < 0 else end
            if stop > start:
                progress |= self._add(text[start:stop], pieces)
            if end < 0:
                return pieces, progress and self._cr
            pieces.append(self._end_line())
            progress = False  # that progress line ended
            start = end + 1

    def _add(self, segment: str, pieces: list[str]) -> bool:
        """Append ``segment`` (no newline) to the open line; True if it is a progress line."""
        if "\r" in segment:
            states = segment.split("\r")
            current = "".join(self._parts) + states[0]  # finished by the first '\r'
            if current:
                self._done = current
            for state in states[1:-1]:
                if state:
                    self._done = state
            self._parts = [states[-1]] if states[-1] else []
            self._size = len(states[-1])
            self._cr = True
        else:
            self._parts.append(segment)
            self._size += len(segment)
        if self._max is not None and self._size >= self._max:
            # A line this long is passed on in pieces: the start of it is shown now.
            pieces.append("".join(self._parts))
            self._parts, self._size, self._done, self._cr = [], 0, "", False
            return False
        return True

    def _end_line(self) -> str:
        line = "".join(self._parts) if self._parts else self._done
        self._parts, self._size, self._done, self._cr = [], 0, "", False
        return line + "\n"


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
        # (key, stream) -> [last text shown, shown_at, dirty]
        self._progress: dict[tuple[str, str], list] = {}
        self._mid_line: set[tuple[str, str]] = set()  # a piece of a long line was shown

    def _prefix(self, key: str) -> str:
        return f"[{key}] " if self.tag else ""

    def visible(self, key: str) -> bool:
        return self.show is None or key in self.show

    def feed(self, key: str, stream: str, data: bytes) -> None:
        splitter = self._splitters.setdefault((key, stream), LineSplitter())
        pieces, progress = splitter.feed(data)
        self._emit(key, stream, pieces)
        if progress and self.visible(key):
            state = self._progress.setdefault((key, stream), ["", 0.0, False])
            state[2] = True
            self.tick()

    def _emit(self, key: str, stream: str, pieces: list[str]) -> None:
        if not pieces:
            return
        if not self.visible(key):
            self._held.setdefault(key, deque(maxlen=self._keep)).extend((stream, p) for p in pieces)
            return
        state = self._progress.pop((key, stream), None)
        if state is not None:  # the progress line is finished: it stays where it was shown
            first = pieces[0]
            if first.endswith("\n"):
                self.sink.progress(key, stream, self._prefix(key) + first[:-1], final=True)
                pieces = pieces[1:]
            else:  # it grew too long to be a progress line: it goes on as text
                self.sink.progress(key, stream, self._prefix(key) + state[0], final=True)
        if pieces:
            self.sink.write(stream, self._tagged(key, stream, pieces, self._mid_line))

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

    def tick(self) -> None:
        """Show throttled progress updates that are due."""
        now = time.monotonic()
        for (key, stream), state in self._progress.items():
            if state[2] and now - state[1] >= self.progress_interval:
                state[0] = self._splitters[(key, stream)].progress_text()
                self.sink.progress(key, stream, self._prefix(key) + state[0], final=False)
                state[1], state[2] = now, False

    def close(self) -> None:
        """The processes are gone: print partial last lines, settle progress lines."""
        for (key, stream), splitter in self._splitters.items():
            if (key, stream) in self._progress:
                self._progress[(key, stream)][0] = splitter.progress_text()
            self._emit(key, stream, splitter.flush())
        for (key, stream), state in list(self._progress.items()):
            self.sink.progress(key, stream, self._prefix(key) + state[0], final=True)
        self._progress.clear()

    def replay_hidden(self, header: str) -> None:
        """After a failure: show what the hidden ranks said lately."""
        mid_line: set = set()
        for key, held in self._held.items():
            if held and not self.visible(key):
                self.sink.write("stderr", header.format(key=key) + "\n")
                for stream, piece in held:
                    self.sink.write(stream, self._tagged(key, stream, [piece], mid_line))
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
