"""The GPUs a job's ranks run on, reserved from the cluster as a Ray placement group.

A job whose plan places ranks by GPU (:mod:`taas.launch.ray.placement`) holds one placement
group: ``{"GPU": 1}`` per rank, pinned to the planned node's address, ``PACK``.  Its ranks are
no Ray tasks, so the group is what tells the cluster (and other users' jobs, other kernels)
that those GPUs are taken.

The group is given back :data:`LINGER` s after no job of ours needs it any more -- its ranks
have all exited (:class:`~taas.launch.ray.job.RayJob` lets go then, before the results are
read), or the job closed -- and at once at the launcher's shutdown: GPUs held between cells
would block other work on a shared cluster.  A job that asks for the same bundles while the
group is still held (the next attempt, or the next cell of a Run All) reuses it.

Cells run back to back (Run All) ask for the GPUs the last cell has just given back.  Ray
returns a removed group's GPUs within ~0.03-0.1 s (measured on the simulated cluster), but a
group asked for before they are back is pending, and the GCS retries pending groups with a
backoff (100 ms growing to 1 s): such a group was ready only after 0.35-0.7 s, while one asked
for once the GPUs were back was ready in ~5 ms.  So for :data:`RETURN_WINDOW` s after it
removed a group, :meth:`Reservation.hold` first waits until the cluster counts the GPUs it
needs as available (:func:`gpus_fit`, polled), then asks.  That wait still cost a back-to-back
cell 0.03-0.08 s that a cell after a pause did not pay (warm 4-rank cells: 0.27 s back to back
against 0.21 s after a 1 s pause), so the group lingers for :data:`LINGER` s after its last
job: the next cell of a Run All, asked for within it, reuses the group and waits for nothing;
a cell after a longer pause asks afresh (~5 ms, its GPUs long back).  Other work on the
cluster waits at most that long for GPUs taas no longer uses.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from taas.errors import LaunchError

TIMEOUT = 30.0  # seconds to wait for the cluster to reserve the job's GPUs
# Seconds after we removed a group during which its GPUs count as on their way back to the
# cluster (measured back in 0.03-0.1 s; a busy GCS is slower).  After it, hold() asks at once.
RETURN_WINDOW = 2.0
_POLL = 0.01  # seconds between two looks at the cluster's available GPUs (one GCS call, < 1 ms)
# Seconds a group outlives its last job, for a cell run right after (Run All: milliseconds
# between cells; a person's pause is seconds).  0: given back at once.
LINGER = 0.5


def bundles(ips: list[str]) -> list[dict]:
    """The placement group's bundles for ranks on the nodes at ``ips`` (one entry per rank)."""
    return [{"GPU": 1, f"node:{ip}": 0.001} for ip in ips]


def _need(wanted: list[dict]) -> Counter:
    """GPUs per node address that ``wanted`` (bundles as :func:`bundles` makes them) asks for."""
    need: Counter = Counter()
    for bundle in wanted:
        for key in bundle:
            if key.startswith("node:"):
                need[key[len("node:"):]] += int(bundle.get("GPU", 0))
    return need


def gpus_fit(wanted: list[dict]) -> bool | None:
    """Whether the cluster counts the GPUs ``wanted`` needs as available now: per node where
    this connection can ask (``ray._private.state``, a Ray driver), else in the whole cluster
    (through Ray Client); None when it cannot tell at all."""
    import ray

    need = _need(wanted)
    try:
        from ray._private.state import available_resources_per_node

        free: dict[str, float] = {}
        for resources in available_resources_per_node().values():
            for key in resources:  # a node's own resource, node:<ip>, names its address
                if key.startswith("node:") and key != "node:__internal_head__":
                    free[key[len("node:"):]] = float(resources.get("GPU", 0.0))
        return all(free.get(ip, 0.0) >= count for ip, count in need.items())
    except Exception:  # broad: a Ray without this developer call, or not a driver (Ray Client)
        pass
    try:
        return float(ray.available_resources().get("GPU", 0.0)) >= sum(need.values())
    except Exception:  # broad: whatever Ray raises, the answer is "cannot tell"
        return None


class Reservation:
    """At most one placement group, held while any job that asked for it runs.

    ``fits`` (default :func:`gpus_fit`) says whether the cluster has the GPUs of some bundles
    available now (None: cannot tell); tests give their own."""

    def __init__(self, fits: Callable[[list[dict]], bool | None] | None = None) -> None:
        self._lock = threading.Lock()
        self._group: Any = None  # the placement group (Ray's PlacementGroup)
        self._bundles: list[dict] | None = None
        self._holders: set[str] = set()  # attempts that hold the group
        self._fits = fits or gpus_fit
        self._removed_at: float | None = None  # time.monotonic() when we last removed a group
        self._linger: threading.Timer | None = None  # removes the group LINGER s after its last job

    @property
    def held(self) -> list[dict] | None:
        """The bundles of the group held now, or None."""
        return self._bundles

    def hold(self, bundles: list[dict], attempt: str) -> None:
        """Reserve ``bundles`` for ``attempt``, reusing the group held when it is the same;
        raises LaunchError (one line) when the cluster does not reserve them in time."""
        from ray.util.placement_group import placement_group

        with self._lock:
            self._holders.add(attempt)
            self._stop_lingering()
            if self._group is not None and self._bundles == bundles:
                return
            self._remove_locked()
            self._await_return(bundles)
            group = placement_group(bundles, strategy="PACK", name=f"taas-{attempt}")
            if not group.wait(TIMEOUT):
                _remove(group)
                self._holders.discard(attempt)
                raise LaunchError(f"the cluster did not reserve {len(bundles)} GPU(s) in "
                                  f"{TIMEOUT:.0f} s: other work holds them; try again, or use fewer --gpus")
            self._group, self._bundles = group, bundles

    def _await_return(self, wanted: list[dict]) -> None:
        """Within RETURN_WINDOW s of our last removal, wait until ``wanted`` fits (see the
        module: a group asked for earlier waits out Ray's retry backoff).  Outside it, or when
        the cluster cannot tell, at once: GPUs held by other work are the group's own wait."""
        if self._removed_at is None:
            return
        deadline = self._removed_at + RETURN_WINDOW
        while time.monotonic() < deadline:
            fits = self._fits(wanted)
            if fits is None or fits:
                return
            time.sleep(_POLL)

    def let_go(self, attempt: str) -> None:
        """``attempt`` no longer needs its GPUs: they go back :data:`LINGER` s after no job of
        ours holds them, unless one asks for them again meanwhile.  Calling it again (the job's
        close after its ranks ended) does nothing."""
        with self._lock:
            self._holders.discard(attempt)
            if self._holders or self._group is None or self._linger is not None:
                return
            if LINGER <= 0:
                self._remove_locked()
                return
            timer = self._linger = threading.Timer(LINGER, lambda: self._linger_ended(timer))
            timer.daemon = True
            timer.start()

    def _linger_ended(self, timer: threading.Timer) -> None:
        with self._lock:
            if self._linger is not timer:  # a hold() stopped it while it waited for the lock
                return
            self._linger = None
            if not self._holders:
                self._remove_locked()

    def _stop_lingering(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def release(self) -> None:
        """Give the group back whoever holds it (the launcher shuts down)."""
        with self._lock:
            self._holders.clear()
            self._stop_lingering()
            self._remove_locked()

    def _remove_locked(self) -> None:
        if self._group is not None:
            _remove(self._group)
            self._removed_at = time.monotonic()
        self._group, self._bundles = None, None


def _remove(group) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:  # broad: the cluster freed it already (the driver is leaving)
        pass
