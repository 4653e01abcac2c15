"""One stream's bytes into pieces of lines and progress states (:class:`LineSplitter`).

Decoding is incremental (a UTF-8 character split across two reads stays whole).  A carriage
return (tqdm) starts a new state of the same line: the latest state is a progress update, and
the text that the newline finally ends is the line.  Its cost is linear in the bytes fed: only
new data is searched for newlines, a line is kept as a list of chunks, a progress line keeps
only its latest states, and a line longer than ``max_line`` characters is passed on in pieces,
each as soon as ``max_line`` characters of it have come (so that 50 MB printed without a newline
neither waits for the end of the job nor costs time quadratic in its length).  Pure.
"""

from __future__ import annotations

import codecs

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
