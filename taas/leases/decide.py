"""The lease decisions, pure: "GPUs seen, leases held, requests waiting" -> a decision, and the
lines that tell the user.  No files, no clock: every input is data.

Rules:

- a GPU is free when no lease holds it and other programs use no more than ``busy_mib`` of its
  memory (busy outside taas otherwise: never offered, said once);
- a request takes GPUs only when no live request is ahead of it in line (first come, first
  served; a request whose holder died is no longer in line, :mod:`taas.leases.locks`) and enough
  are free, and then the free ones with the lowest indices, all it asked for at once (all or
  nothing: no job ever holds part of what it waits for, so no two jobs wait for each other).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from taas.leases.api import Decision, Gpu, Holder, Take, Ticket, Wait


def busy_outside(gpu: Gpu, held: Mapping[str, Holder], busy_mib: int) -> bool:
    """Other programs use this GPU heavily and no taas lease explains it."""
    return gpu.uuid not in held and gpu.used_mib > busy_mib


def decide(gpus: Sequence[Gpu], held: Mapping[str, Holder], queue: Sequence[Ticket], me: str,
           count: int, busy_mib: int) -> Decision:
    """What request ``me`` (a name in ``queue``, or not yet in it) for ``count`` GPUs does now."""
    ahead = [t for t in queue if t.name < me]
    order = sorted(gpus, key=lambda g: g.index)
    busy = tuple(g for g in order if busy_outside(g, held, busy_mib))
    free = [g for g in order if g.uuid not in held and g not in busy]
    if not ahead and len(free) >= count:
        return Take(tuple(g.uuid for g in free[:count]))
    taken = tuple((g, held[g.uuid]) for g in order if g.uuid in held)
    return Wait(place=len(ahead) + 1, free=len(free), held=taken, busy=busy, ahead=len(ahead))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _since(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch)) if epoch else "?"


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def holder_text(holder: Holder) -> str:
    """``job ab12cd34ef56 (alice, since 14:02:07, train.ipynb)``"""
    facts = [holder.user, f"since {_since(holder.since)}"] + ([holder.notebook] if holder.notebook else [])
    return f"job {holder.job} ({', '.join(facts)})"


def _why(wait: Wait) -> str:
    parts = [f"GPU {gpu.index} leased by {holder_text(holder)}" for gpu, holder in wait.held]
    parts += [f"GPU {gpu.index} busy outside taas ({_gib(gpu.used_mib)} used)" for gpu in wait.busy]
    return "; ".join(parts)


def wait_line(count: int, wait: Wait) -> str:
    """The one line a waiting cell shows, updated in place."""
    why = _why(wait)
    ahead = f", {wait.ahead} ahead" if wait.ahead else ""
    return (f"taas: waiting for {count} GPU(s), {wait.free} free" + (f": {why}" if why else "")
            + f"; {_ordinal(wait.place)} in line{ahead} (interrupt to stop waiting)")


def refusal(count: int, wait: Wait) -> str:
    """``--no-wait``'s one-line error: the same facts, and nothing started."""
    why = _why(wait)
    ahead = f"; {wait.ahead} job(s) already waiting" if wait.ahead else ""
    return (f"--no-wait: {count} GPU(s) asked, {wait.free} free" + (f": {why}" if why else "")
            + f"{ahead}; nothing was started")


def busy_note(gpus: Sequence[Gpu]) -> str:
    """Said once per cell: GPUs busy outside taas are not offered."""
    named = ", ".join(f"GPU {g.index} ({g.uuid}, {_gib(g.used_mib)} used)" for g in gpus)
    return f"taas: busy outside taas, so not offered to this job: {named}"


def gpu_lines(gpus: Sequence[Gpu], held: Mapping[str, Holder], busy_mib: int) -> list[str]:
    """``%taas`` and ``taas jobs``: each GPU of this machine, free, leased (by which job) or
    busy outside taas; then leases on GPUs not seen here (another container's)."""
    lines = []
    seen = set()
    for gpu in sorted(gpus, key=lambda g: g.index):
        seen.add(gpu.uuid)
        if gpu.uuid in held:
            state = f"leased by {holder_text(held[gpu.uuid])}"
        elif busy_outside(gpu, held, busy_mib):
            state = f"busy outside taas ({_gib(gpu.used_mib)} used)"
        else:
            state = "free"
        lines.append(f"  GPU {gpu.index} {gpu.uuid}: {state}")
    for uuid in sorted(set(held) - seen):
        lines.append(f"  {uuid} (not visible here): leased by {holder_text(held[uuid])}")
    return lines
