"""Identical lines of many ranks, shown once: ``[rank0-31] epoch done``.  Pure; time is given.

A :class:`Collapser` is fed whole lines as ``(rank, stream, text, now)`` and gives back
:class:`Shown` lines, each with the ranks that printed it.  Each rank's lines wait in its own
queue (stdout and stderr together, so that one rank's lines keep their order across both);
only the *heads* of the queues are ever shown, so no rank's lines are reordered, whatever order
the ranks' pipes were read in.  The ranks whose heads are the same line are shown as one line.

The head line T of some ranks is shown

* once it is decided and ``settle`` seconds old: every other expected rank has a line
  waiting, none of them has T later in its queue (then that rank's earlier lines go first,
  and it joins T after them);
* or ``hold`` seconds after the oldest waiting line came, when the ranks it waits for printed
  nothing lately (see ``_catching_up``: a rank that prints nothing else); ``max_hold`` seconds
  after, when they print but are far behind (ranks sharing too few
  cores, a kernel that takes long to read them all); or when more than
  ``limit`` lines per rank wait (memory and latency stay bounded).

When several head lines are decided, the oldest goes first, and of those that came at the
same moment (within ``settle``) the lowest rank's: ranks printing distinct lines together show
in rank order.  The cost is linear in the lines: a line
costs a few dictionary updates when it comes and when it is shown, and picking what to show
next looks at the decided head lines only (at most one per rank).  :attr:`Collapser.steps`
counts that work, so that a test can check it without a clock.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

HOLD = 0.3  # seconds a line waits for the other ranks' identical line, if they are silent
MAX_HOLD = 5.0  # seconds it waits at most, for ranks that print but are behind
# Seconds a decided line still waits: the ranks' pipes are read one after the other, so a
# rank's earlier line can come a moment after another rank's later one; this lets it come.
SETTLE = 0.1
# Lines waiting per rank at most; past it the oldest is shown as it is.  A read brings up to
# 64 kB of a rank's output (4,000 short lines): this holds two reads of every rank.
LIMIT = 8192


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


@dataclass(eq=False, slots=True)
class _Line:
    key: tuple[str, str]  # (stream, text)
    born: float
    rank: int
    done: bool = False


class Collapser:
    """Whole lines of ``ranks`` -> :class:`Shown` lines (see the module's docstring)."""

    def __init__(self, ranks: Iterable[int], hold: float = HOLD, limit: int = LIMIT,
                 settle: float = SETTLE, max_hold: float = MAX_HOLD) -> None:
        self.hold, self.limit, self.settle = hold, limit, min(settle, hold)
        self.max_hold = max(hold, max_hold) if hold > 0 else 0.0  # hold 0: nothing waits
        # rank -> the round (calls of due) and the time its latest line came in
        self._arrived: dict[int, tuple[int, float]] = {}
        self._round = 0
        self._expected = set(ranks)  # ranks that may still print: decisions wait for them
        self._cap = limit * max(1, len(self._expected))  # lines waiting at most
        self._queues: dict[int, deque[_Line]] = {}
        self._counts: dict[int, dict[tuple[str, str], int]] = {}  # rank -> key -> lines waiting
        self._holders: dict[tuple[str, str], int] = {}  # key -> ranks with it waiting
        self._heads: dict[tuple[str, str], set[int]] = {}  # key -> ranks whose head line it is
        self._ready: dict[tuple[str, str], None] = {}  # head keys no other rank holds later
        self._order: deque[_Line] = deque()  # every waiting line, oldest first (shown ones skipped)
        self._waiting = 0
        self._idle = len(self._expected)  # expected ranks with no line waiting
        self.steps = 0  # work done, for tests of the cost

    @property
    def held(self) -> int:
        """Lines waiting."""
        return self._waiting

    def add(self, rank: int, stream: str, text: str, now: float) -> list[Shown]:
        """Rank ``rank`` printed the line ``text``; what can be shown now."""
        return self.extend(rank, stream, [text], now)

    def extend(self, rank: int, stream: str, texts: list[str], now: float) -> list[Shown]:
        """Rank ``rank`` printed the lines ``texts`` (as one read brings them); what can be
        shown now.  The common case (a rank repeating a line it has waiting) touches no set."""
        queue = self._queues.get(rank)
        if queue is None:
            queue = self._queues[rank] = deque()
            self._counts[rank] = {}
        counts, order = self._counts[rank], self._order
        for text in texts:
            key = (stream, text)
            line = _Line(key, now, rank)
            queue.append(line)
            order.append(line)
            held = counts.get(key, 0)
            counts[key] = held + 1
            if len(queue) == 1:  # its head: a rank with nothing waiting now has this
                self._heads.setdefault(key, set()).add(rank)
                if rank in self._expected:
                    self._idle -= 1
                if not held:
                    self._holders[key] = self._holders.get(key, 0) + 1
                self._check(key)
            elif not held:  # a line it holds behind its head: others must not show it first
                self._holders[key] = self._holders.get(key, 0) + 1
                self._check(key)
        self._waiting += len(texts)
        self.steps += len(texts)
        self._arrived[rank] = (self._round, now)
        return self._release(now)

    def end(self, rank: int, now: float) -> list[Shown]:
        """Rank ``rank`` prints nothing more (its stream ended, or it is hidden)."""
        if rank in self._expected:
            self._expected.discard(rank)
            if not self._queues.get(rank):
                self._idle -= 1
        return self._release(now)

    def due(self, now: float) -> list[Shown]:
        """The waiting lines whose time is up.  Call it after each round of reads (every
        process's output that was ready): a rank that printed nothing since the round before
        is silent, not merely unread yet."""
        self._round += 1
        return self._release(now, timed=True)

    def through(self, rank: int) -> list[Shown]:
        """Every line of rank ``rank`` still waiting, shown now: what it shows next outside of
        this collapser (a piece of a long line, a progress bar) must come after them."""
        out = []
        queue = self._queues.get(rank)
        while queue:
            out.append(self._show(queue[0].key))
        return out

    def flush(self) -> list[Shown]:
        """The job ended: every waiting line.  No rank prints more, so every head line no other
        rank holds later is decided now (output that came all at once still collapses)."""
        self._expected.clear()
        self._idle = 0
        out = []
        while self._waiting:
            key = self._first_ready(float("inf")) if self._ready else None
            out.append(self._show(key if key is not None else self._oldest().key))
        return out

    # ------------------------------------------------------------------------------------
    def _release(self, now: float, timed: bool = False) -> list[Shown]:
        out = []
        while self._waiting:
            oldest = self._oldest()
            age = now - oldest.born
            if (self._waiting > self._cap or age >= self.max_hold
                    or timed and age >= self.hold and not self._catching_up(now)):
                out.append(self._show(oldest.key))
            elif self._idle > 0 or now - oldest.born < self.settle:
                break  # a rank with nothing waiting may still print any of these lines
            elif self._ready:
                key = self._first_ready(now)
                if key is None:
                    break
                out.append(self._show(key))
            else:  # every head is waited for by another rank (A then B here, B then A there)
                out.append(self._show(oldest.key))
        return out

    def _catching_up(self, now: float) -> bool:
        """Whether a rank the waiting lines wait for (one with none waiting) printed lately:
        it is behind, not silent.  Lately: in this round of reads or the one before (a round
        can take long when there is much to read), or within ``hold`` seconds (a rank can be
        off its core for a while).  One pass over the ranks, only once a line waited ``hold``."""
        self.steps += len(self._expected)
        for r in self._expected:
            if r in self._arrived and not self._queues.get(r):
                round_, at = self._arrived[r]
                if round_ >= self._round - 1 or now - at < self.hold:
                    return True
        return False

    def _oldest(self) -> _Line:
        while self._order[0].done:
            self._order.popleft()  # shown out of arrival order earlier
        return self._order[0]

    def _first_ready(self, now: float) -> tuple[str, str] | None:
        """The decided head line to show next, if one settled: the oldest, and among lines that
        came within ``settle`` of it (the same moment, as far as pipes tell) the lowest rank's,
        so that ranks printing at once show in rank order."""
        found: list[tuple[float, int, tuple[str, str]]] = []
        for key in self._ready:
            heads = self._heads[key]
            self.steps += len(heads)
            born = max(self._queues[r][0].born for r in heads)
            if now - born >= self.settle:
                found.append((min(self._queues[r][0].born for r in heads), min(heads), key))
        if not found:
            return None
        oldest = min(born for born, _, _ in found)
        return min((rank, key) for born, rank, key in found if born <= oldest + self.settle)[1]

    def _check(self, key: tuple[str, str]) -> None:
        heads = self._heads.get(key)
        if heads and len(heads) == self._holders.get(key, 0):
            self._ready[key] = None
        else:
            self._ready.pop(key, None)

    def _show(self, key: tuple[str, str]) -> Shown:
        """The head line ``key``, for every rank whose head it is."""
        ranks = sorted(self._heads[key])
        for rank in ranks:
            self._pop(rank)
        return Shown(key[0], tuple(ranks), key[1])

    def _pop(self, rank: int) -> None:
        queue, counts = self._queues[rank], self._counts[rank]
        line = queue.popleft()
        line.done = True
        self._waiting -= 1
        self.steps += 1
        key = line.key
        if queue and queue[0].key == key:  # the same line again: still its head, still held
            counts[key] -= 1
            return
        self._heads[key].discard(rank)
        if not self._heads[key]:
            del self._heads[key]
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
        self._check(key)
        if queue:
            head = queue[0].key
            self._heads.setdefault(head, set()).add(rank)
            self._check(head)
        elif rank in self._expected:
            self._idle += 1
