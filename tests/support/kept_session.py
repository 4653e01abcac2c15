"""A Session's kept-ranks face with no ranks, for a kept job's host (taas.host.kept) in tests."""

from __future__ import annotations

import contextlib
import math
import threading

from taas.job.api import World


class _Kept:
    world = World(2, "cpu", "gloo")
    limit = math.inf
    job_id = "k1"
    cells = 1

    def idle(self) -> float:
        return 0.0

    def expired(self) -> bool:
        return False

    def flag(self) -> str:
        return "--keep"


class _Keeper:
    def __init__(self, session: KeptSession):
        self.session = session

    def take(self, sink):
        return self.session.kept

    def after_cell(self, kept, shipped: dict) -> None:
        self.session.kept = kept


class KeptSession:
    """A Session's kept-ranks face, with no ranks."""

    def __init__(self):
        self.kept: _Kept | None = _Kept()
        self.keeper = _Keeper(self)
        self._running = threading.Lock()

    @contextlib.contextmanager
    def hold(self):
        with self._running:
            yield

    def release(self, sink=None):
        if self.kept is None:
            return None
        self.kept = None
        return "taas: released the kept ranks (2 on cpu/gloo)"
