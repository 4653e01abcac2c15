"""Identical lines of many ranks, shown once: ``[rank0-31] epoch done``.  Pure; time is given.

A :class:`Collapser` is fed whole lines as ``(rank, stream, text, now)`` and gives back
:class:`Shown` lines, each with the ranks that printed it.  A line is *held* (a pending group)
until it is known which ranks print it:

* rank r's line joins the oldest pending group of the same stream and text that lies after
  rank r's previous line, or starts a new group at the end.  Groups are shown first in, first
  out, so one rank's lines keep their order (across stdout and stderr too).
* a group is *decided* once every expected rank either joined it or printed a later line (it
  can no longer join: see above).  The oldest group is shown as soon as it is decided, or
  ``hold`` seconds after it began (a rank that prints nothing else, a rank far behind), or when
  more than ``limit`` groups are held (the buffer is bounded: memory and latency stay bounded
  whatever the ranks print).

The cost is linear in the lines: each line is one dictionary look-up plus a cursor that only
moves forward over its text's groups; a group costs one pass over the ranks when it becomes
the oldest.  :attr:`Collapser.steps` counts that work, so that a test can check it without a
clock.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

HOLD = 0.3  # seconds a line waits at most for the other ranks' identical line
LIMIT = 4096  # groups held at most; past it the oldest is shown as it is


@dataclass(frozen=True)
class Shown:
    """A line to show: ``text`` (with its newline) on ``stream``, printed by ``ranks``."""

    stream: str
    ranks: tuple[int, ...]
    text: str


def tag(ranks: Iterable[int]) -> str:
    """Ranks as a user reads them: ``0-3``, ``1,3``, ``0-2,5`` (runs of two or more as ranges)."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def expand(text: str) -> list[int]:
    """The inverse of :func:`tag`: ``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    ranks: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


_RATE = re.compile(r"[\d.]+ ?(?:s/it|it/s)")
_WORD = re.compile(r"[^\W\d_]+")


def bar_shape(text: str) -> tuple[str, ...]:
    """What stays the same while a progress bar advances: its words, without numbers, the bar's
    glyphs and tqdm's rate (``4.5it/s`` on one rank, ``1.2s/it`` on another)."""
    return tuple(_WORD.findall(_RATE.sub("", text)))


@dataclass(eq=False)
class _Group:
    seq: int
    stream: str
    text: str
    born: float
    ranks: list[int] = field(default_factory=list)


class _Same:
    """The pending groups of one (stream, text), oldest first, and each rank's cursor into them
    (the index of the first group that rank has not yet joined or passed)."""

    __slots__ = ("groups", "head", "cursor")

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.head = 0  # groups before it were shown
        self.cursor: dict[int, int] = {}

    def compact(self) -> None:
        # Shown groups are dropped in batches, so that this list stays as long as what is held.
        if self.head >= 256 and self.head * 2 >= len(self.groups):
            del self.groups[:self.head]
            self.cursor = {r: max(0, i - self.head) for r, i in self.cursor.items()}
            self.head = 0


class Collapser:
    """Whole lines of ``ranks`` -> :class:`Shown` lines (see the module's docstring)."""

    def __init__(self, ranks: Iterable[int], hold: float = HOLD, limit: int = LIMIT) -> None:
        self.hold, self.limit = hold, limit
        self._expected = set(ranks)  # ranks whose next line may still join a held group
        self._last: dict[int, int] = {}  # rank -> seq of the group its latest line is in
        self._queue: deque[_Group] = deque()
        self._same: dict[tuple[str, str], _Same] = {}
        self._seq = 0
        self._lagging = 0  # expected ranks that neither joined nor passed the oldest group
        self.steps = 0  # work done, for tests of the cost

    @property
    def held(self) -> int:
        return len(self._queue)

    def add(self, rank: int, stream: str, text: str, now: float) -> list[Shown]:
        """Rank ``rank`` printed the line ``text``; what can be shown now."""
        last = self._last.get(rank, -1)
        same = self._same.get((stream, text))
        if same is None:
            same = self._same[(stream, text)] = _Same()
        i = max(same.cursor.get(rank, 0), same.head)
        while i < len(same.groups) and same.groups[i].seq <= last:
            i += 1  # a group this rank passed: it can never join it
            self.steps += 1
        self.steps += 1
        was_empty = not self._queue
        if i < len(same.groups):
            group = same.groups[i]
        else:
            group = _Group(self._seq, stream, text, now)
            self._seq += 1
            same.groups.append(group)
            self._queue.append(group)
        group.ranks.append(rank)
        same.cursor[rank] = i + 1
        self._last[rank] = group.seq
        if was_empty:
            self._lagging = self._count_lagging()
        elif rank in self._expected and last < self._queue[0].seq <= group.seq:
            self._lagging -= 1  # this rank joined or passed the oldest group
        return self._release(now)

    def end(self, rank: int, now: float) -> list[Shown]:
        """Rank ``rank`` prints nothing more (its stream ended, or it is hidden)."""
        if rank in self._expected:
            self._expected.discard(rank)
            if self._queue:
                self._lagging = self._count_lagging()
        return self._release(now)

    def due(self, now: float) -> list[Shown]:
        """The held lines whose time is up (call it periodically)."""
        return self._release(now)

    def through(self, rank: int) -> list[Shown]:
        """Everything up to rank ``rank``'s latest held line, shown now: what it shows next
        outside of this collapser (a piece of a long line, a progress bar) must come after."""
        last = self._last.get(rank, -1)
        out = []
        while self._queue and self._queue[0].seq <= last:
            out.append(self._pop())
        return out

    def flush(self) -> list[Shown]:
        """The job ended: every held line, as it is."""
        out = []
        while self._queue:
            out.append(self._pop())
        return out

    # ------------------------------------------------------------------------------------
    def _release(self, now: float) -> list[Shown]:
        out = []
        while self._queue:
            head = self._queue[0]
            if self._lagging > 0 and now - head.born < self.hold and len(self._queue) <= self.limit:
                break
            out.append(self._pop())
        return out

    def _pop(self) -> Shown:
        group = self._queue.popleft()
        key = (group.stream, group.text)
        same = self._same[key]
        same.head += 1
        if same.head == len(same.groups):
            del self._same[key]  # nothing of this text is held: its cursors go too
        else:
            same.compact()
        if self._queue:
            self._lagging = self._count_lagging()
        return Shown(group.stream, tuple(sorted(group.ranks)), group.text)

    def _count_lagging(self) -> int:
        """Expected ranks that neither joined nor passed the oldest group: one pass over the
        ranks, once per group that becomes the oldest."""
        head = self._queue[0]
        self.steps += len(self._expected)
        # A rank whose latest line is in a later group passed it; in this group, joined it.
        return sum(1 for r in self._expected if self._last.get(r, -1) < head.seq)
