"""A sink (:class:`taas.io.output.Sink`) for tests of what the cell shows: it keeps every
write, per stream, and every progress-bar state, in order."""

from __future__ import annotations


class Recorder:
    def __init__(self):
        self.out: list[tuple[str, str]] = []
        self.bars: list[tuple[str, str, bool]] = []

    def write(self, stream, text):
        self.out.append((stream, text))

    def progress(self, key, stream, text, final):
        self.bars.append((key, text, final))

    def text(self, stream="stdout"):
        """Everything written to ``stream``, joined."""
        return "".join(t for s, t in self.out if s == stream)
