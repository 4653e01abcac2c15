"""A job's output on disk: what its cell would have shown, as records, bounded in bytes.

The host writes one JSON object a line (a *record*: ``{"i": 7, "op": "w", ...}``; ``i`` counts
from 0) into ``out/``: first ``head.jsonl``, up to half the cap, then numbered tail segments of
a quarter of the cap each, the oldest removed when a third begins.  So the first half and the
latest quarter to half of the output are always there, and a gap in ``i`` is what was dropped
(the reader says so in one record: ``{"op": "dropped", "n": ...}``).

What is shown in place (open progress bars, the rank panel, the live plot) is not logged at every
redraw: ``view.json`` holds its latest state, replaced whole (``write_view`` / ``read_view``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import threading

from taas.jobs import api
from taas.jobs.store import write_file

HEAD = "head.jsonl"
_TAIL = re.compile(r"^tail-(\d+)\.jsonl$")


def _tail(n: int) -> str:
    return f"tail-{n}.jsonl"


class LogWriter:
    """Appends records to a record folder's ``out/``, within ``cap`` bytes (thread-safe)."""

    def __init__(self, folder: pathlib.Path, cap: int | None = None, part: str = api.OUT):
        self.out = pathlib.Path(folder) / part
        self.out.mkdir(mode=0o700, exist_ok=True)
        self.cap = cap if cap is not None else api.log_cap()
        self._lock = threading.Lock()
        self._index = 0
        self._segment = HEAD
        self._tail = -1  # the number of the tail segment written now (-1: still the head)
        self._size = 0
        self._fd = self._open(HEAD)
        self.dropped = 0  # records that left the tail segments

    def _open(self, name: str) -> int:
        return os.open(self.out / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def append(self, record: dict) -> None:
        with self._lock:
            line = json.dumps(dict(record, i=self._index), separators=(",", ":")).encode() + b"\n"
            limit = self.cap // 2 if self._tail < 0 else self.cap // 4
            if self._size and self._size + len(line) > limit:
                self._next_segment()
            os.write(self._fd, line)
            self._size += len(line)
            self._index += 1

    def _next_segment(self) -> None:
        os.close(self._fd)
        self._tail += 1
        self._fd = self._open(_tail(self._tail))
        self._size = 0
        old = self.out / _tail(self._tail - 2)
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass

    @property
    def count(self) -> int:
        return self._index

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class LogReader:
    """Reads a record folder's output log from the start (or near its end) and then follows it:
    each :meth:`read` returns the records written since the last one, a ``dropped`` record where
    the log lost some.  Memory: one segment's unread part at most."""

    def __init__(self, folder: pathlib.Path, part: str = api.OUT):
        self.out = pathlib.Path(folder) / part
        self._segment: str = HEAD
        self._offset = 0
        self._next = 0  # the index of the next record expected
        self._with_index = False

    def _segments(self) -> list[str]:
        try:
            names = os.listdir(self.out)
        except FileNotFoundError:
            return []
        tails = sorted((int(m.group(1)), name) for name in names if (m := _TAIL.match(name)))
        return ([HEAD] if HEAD in names else []) + [name for _, name in tails]

    def start_near_end(self, records: int) -> int:
        """Skip to the last ``records`` records; how many earlier ones are skipped."""
        need = records
        for name in reversed(self._segments()):
            data = _read(self.out / name)
            if data is None:
                continue
            end = data.rfind(b"\n") + 1  # complete lines only
            lines = data[:end].count(b"\n")
            if lines >= need or name == HEAD:
                cut = end
                for _ in range(min(need, lines)):
                    cut = data.rfind(b"\n", 0, cut - 1) + 1 if cut > 1 else 0
                self._segment, self._offset = name, cut
                first = self._first_index(data[cut:end]) if cut < end else None
                self._next = first if first is not None else self._next
                return self._next
            need -= lines
        return 0

    def start_at_latest_bytes(self, nbytes: int) -> bool:
        """Skip to the record that holds the log's last ``nbytes`` bytes (reading only about
        that much); whether anything earlier was skipped.  The first record read may start
        before that point: the caller trims it."""
        need = nbytes
        for name in reversed(self._segments()):
            try:
                size = (self.out / name).stat().st_size
            except FileNotFoundError:
                continue
            if size < need and name != HEAD:
                need -= size
                continue
            offset = max(0, size - need)
            with open(self.out / name, "rb") as file:
                back = max(0, offset - 65536)  # where the record holding ``offset`` starts
                while True:
                    file.seek(back)
                    window = file.read(offset - back)
                    cut = window.rfind(b"\n")
                    if cut >= 0 or back == 0:
                        start = back + cut + 1 if cut >= 0 else 0
                        break
                    back = max(0, back - 65536)
                file.seek(start)
                first = self._first_index(file.readline())
            self._segment, self._offset = name, start
            if first is not None:
                self._next = first
            return first is not None and first > 0
        return False

    @staticmethod
    def _first_index(data: bytes) -> int | None:
        line = data.split(b"\n", 1)[0]
        try:
            return int(json.loads(line)["i"])
        except (ValueError, KeyError, TypeError):
            return None

    def read(self, with_index: bool = False) -> list[dict]:
        """The records written since the last read (``with_index``: each keeps its ``i``)."""
        self._with_index = with_index
        out: list[dict] = []
        segments = self._segments()
        if self._segment not in segments:  # fell behind a removed segment: the oldest left
            tails = [s for s in segments if s != HEAD]
            if not tails:
                return out
            self._segment, self._offset = tails[0], 0
        while True:
            self._drain(out)
            later = [s for s in self._segments() if _order(s) > _order(self._segment)]
            if not later:
                return out
            # A newer segment exists, so the writer finished this one: read what it added
            # between the two looks, then go on to the next.
            self._drain(out)
            self._segment, self._offset = later[0], 0

    def _drain(self, out: list[dict]) -> None:
        data = _read(self.out / self._segment, self._offset)
        if data:
            end = data.rfind(b"\n") + 1  # complete lines only
            for line in data[:end].splitlines():
                self._take(line, out)
            self._offset += end

    def _take(self, line: bytes, out: list[dict]) -> None:
        try:
            record = json.loads(line)
            index = int(record["i"] if self._with_index else record.pop("i"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # a line that cannot be read (a crash mid-write): skipped
        if index > self._next:
            out.append({"op": "dropped", "n": index - self._next})
        if index >= self._next:
            out.append(record)
            self._next = index + 1


def _order(segment: str) -> int:
    match = _TAIL.match(segment)
    return int(match.group(1)) if match else -1


def _read(path: pathlib.Path, offset: int = 0) -> bytes | None:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read()
    except FileNotFoundError:
        return None


def write_view(folder: pathlib.Path, view: dict) -> None:
    write_file(pathlib.Path(folder) / api.VIEW, json.dumps(view, separators=(",", ":")).encode())


def read_view(folder: pathlib.Path) -> dict:
    try:
        return json.loads((pathlib.Path(folder) / api.VIEW).read_bytes())
    except (FileNotFoundError, ValueError):
        return {}
