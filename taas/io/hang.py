"""Where were the ranks?  The summary shown when a job hangs, is interrupted or stalls.

Pure functions over plain data.  Each rank is one :class:`Place`: the cell line it was at
and that line's text (the call), its Python stack, or how it had already ended.  Ranks at the
same place are grouped (``rank0,2,3: line 9 dist.all_reduce(t)``); the rank(s) that are not
where the others are get named:

* a rank that already ended (its cell returned, or ``sys.exit(0)``) while others are still
  running is never where they are;
* among the running ranks, when one place holds more ranks than any other, every rank
  elsewhere is named; a tie names nobody ("not all at the same place").

A rank that did not answer (its stack thread had not started, say) is shown as such and never
named; nor is a rank in the debugger (its user's turn, not a hang: the others wait for it).
Stacks are rendered like tracebacks (``Cell In[3], line 9``) via ``name_for``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from taas.io import failure
from taas.io import keys as names
from taas.io.collapse import tag

NO_ANSWER = "no answer"


@dataclass
class Place:
    key: str
    line: int | None = None  # the innermost line of the cell it was at
    call: str = ""  # that line's source text
    frames: list[dict] = field(default_factory=list)  # outermost first
    ended: str | None = None  # how it had already ended ("finished (code 0)"), if it had
    debugger: bool = False  # at the debugger's prompt: the user's turn, never a hang

    @classmethod
    def from_event(cls, key: str, message: dict) -> "Place":
        """From a rank's ``stack`` event (see :mod:`taas.launch.process.stacks`)."""
        return cls(key, message.get("line"), message.get("call") or "", message.get("frames") or [])

    @property
    def where(self) -> str:
        if self.ended:
            return self.ended
        if self.debugger:
            return f"in the debugger at line {self.line}" if self.line is not None else "in the debugger"
        if self.line is not None:
            return f"line {self.line} {self.call}".rstrip()
        if self.frames:
            f = self.frames[-1]
            return f"in {f['name']} ({os.path.basename(f['filename'])}:{f['lineno']})"
        return NO_ANSWER


def label(keys: list[str]) -> str:
    """Ranks as the output's tags write them (``rank0,2-3``, ``rank0-31``: collapse.tag);
    other keys joined by commas."""
    ranks = [names.rank_of(k) for k in keys]
    if keys and None not in ranks:
        return "rank" + tag(r for r in ranks if r is not None)
    return ",".join(keys)


def groups(places: list[Place]) -> list[tuple[list[str], str]]:
    """(keys, where) for each distinct place, in rank order of the first rank there."""
    out: dict[str, list[str]] = {}
    for p in sorted(places, key=lambda p: failure._order(p.key)):
        out.setdefault(p.where, []).append(p.key)
    return [(keys, where) for where, keys in out.items()]


def odd_ones(places: list[Place]) -> list[str]:
    """The keys of the ranks that are not where the others are (see the module docstring)."""
    running = [p for p in places if not p.ended and not p.debugger]
    if not running:
        return []
    odd = [p.key for p in places if p.ended]
    answered = [p for p in running if p.where != NO_ANSWER]  # (a rank in the debugger is none)
    found = groups(answered)
    if len(found) > 1:
        sizes = sorted((len(keys) for keys, _ in found), reverse=True)
        if sizes[0] > sizes[1]:
            odd += [k for keys, _ in found if len(keys) < sizes[0] for k in keys]
    return sorted(odd, key=failure._order)


def odd_sentence(places: list[Place]) -> str | None:
    """"rank1 is not where the others are", or None when nobody can be named."""
    odd = odd_ones(places)
    if not odd:
        return None
    if len(odd) == 1:
        return f"{odd[0]} is not where the others are"
    return f"{', '.join(odd[:-1])} and {odd[-1]} are not where the others are"


def one_line(places: list[Place]) -> str:
    """``rank0,2: line 9 dist.all_reduce(t) | rank1: line 12 dist.barrier()``."""
    return " | ".join(f"{label(keys)}: {where}" for keys, where in groups(places))


def render(places: list[Place], name_for: Callable[[str], str] | None = None) -> list[str]:
    """The lines after an error's first line: where every rank was, then their stacks."""
    lines = []
    sentence = odd_sentence(places)
    debugging = [p.key for p in places if p.debugger and not p.ended]
    if debugging:  # the others wait for it: that is no hang
        lines.append(f"{label(debugging)} {'was' if len(debugging) == 1 else 'were'} in the debugger; "
                     "the others waited for it.")
    if sentence:
        lines.append(sentence + ".")
    elif not debugging and len(groups([p for p in places if p.where != NO_ANSWER])) > 1:
        lines.append("The ranks were not all at the same place.")
    lines.append("Where the ranks were:")
    lines.extend(f"  {label(keys)}: {where}" for keys, where in groups(places))
    stacked = [p for p in sorted(places, key=lambda p: failure._order(p.key)) if p.frames]
    if stacked:
        lines.append("Python stacks (most recent call last):")
    for p in stacked:
        lines.append(f"--- {p.key} ---")
        lines.extend(failure._frame(f, name_for) for f in p.frames)
    return lines
