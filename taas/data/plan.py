"""Unit numbering: who produces and who consumes each unit.  Pure arithmetic, table-tested.

K units, numbered 0..K-1, pass after pass over the loader: unit u is element (u - start of its
pass) of its pass.  With M loader workers and N ranks:

* worker ``u mod M`` produces unit u, in increasing u;
* rank ``u mod N`` consumes it, in increasing u;
* the pair (worker w, rank r) carries traffic iff some u has u = w (mod M) and u = r (mod N),
  i.e. iff w = r (mod gcd(M, N)); each such pair gets one channel.

Deadlock freedom: a worker blocks only on a full channel to rank r, holding units that r will
take before the unit the worker is trying to put; every rank consumes in increasing u, so the
chain of waits always points to a smaller unit and ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from taas.errors import DirectiveError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Plan:
    units: int  # K
    workers: int  # M
    ranks: int  # N
    prefetch: int  # units ready (in total) before the ranks start

    @property
    def gcd(self) -> int:
        return math.gcd(self.workers, self.ranks)

    def producer(self, unit: int) -> int:
        return unit % self.workers

    def consumer(self, unit: int) -> int:
        return unit % self.ranks

    def pairs(self) -> list[tuple[int, int]]:
        """Every (worker, rank) channel that carries units, in a fixed order."""
        g = self.gcd
        return [(w, r) for w in range(self.workers) for r in range(self.ranks) if w % g == r % g]

    def channel(self, worker: int, rank: int) -> int:
        """Index of the (worker, rank) channel in :meth:`pairs`."""
        return self.pairs().index((worker, rank))

    def worker_units(self, worker: int) -> range:
        return range(worker, self.units, self.workers)

    def rank_units(self, rank: int) -> range:
        return range(rank, self.units, self.ranks)

    def workers_of(self, rank: int) -> list[int]:
        """The workers that produce units for ``rank``."""
        return [w for w, r in self.pairs() if r == rank]

    def ranks_of(self, worker: int) -> list[int]:
        return [r for w, r in self.pairs() if w == worker]

    def prefetch_of(self, worker: int) -> int:
        """How many of the first ``prefetch`` units ``worker`` produces."""
        return len(range(worker, self.prefetch, self.workers))


def share(start: int, end: int, rank: int, ranks: int) -> int:
    """How many units u with start <= u < end have u = rank (mod ranks)."""
    if end <= start:
        return 0
    first = start + (rank - start) % ranks
    return 0 if first >= end else (end - 1 - first) // ranks + 1


def resolve_units(units: int | None, length: int | None, name: str) -> int:
    """K for a loader: --units if given, else one pass; a loader without len() needs --units."""
    if units is not None:
        return units
    if length is None:
        raise DirectiveError(
            f"loader `{name}` has no len() (an IterableDataset?), so one pass has no known size: "
            f"add --units K to the directive (K = how many units the ranks take from it)")
    return length


def default_prefetch(units: int, ranks: int, workers: int, asked: int | None) -> int:
    """Units ready before the ranks start: asked, else a tenth of K but at least one per rank
    and per worker; never more than K.  (Workers also report ready when their buffer is full.)"""
    if asked is not None:
        return min(units, asked)
    return min(units, max(ranks, workers, math.ceil(units / 10)))


def mix(*values: int) -> int:
    """A 64-bit seed from integers (splitmix64 steps): stable across processes and runs."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        x = z ^ (z >> 31)
    return x & ((1 << 63) - 1)
