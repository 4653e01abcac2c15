"""A Session's kept-ranks face with no ranks, for a kept job's host (taas.host.kept) in tests."""

from __future__ import annotations

import math

from taas.job.api import World


class _Kept:
    world = World(2, "cpu", "gloo")
    limit = math.inf

    def idle(self) -> float:
        return 0.0

    def expired(self) -> bool:
        return False

    def flag(self) -> str:
        return "--keep"


class KeptSession:
    """A Session's kept-ranks face, with no ranks."""

    def __init__(self):
        self.kept = _Kept()

    def release(self):
        if self.kept is None:
            return None
        self.kept = None
        return "taas: released the kept ranks (2 on cpu/gloo)"
