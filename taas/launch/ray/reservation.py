"""The GPUs a job's ranks run on, reserved from the cluster as a Ray placement group.

A job whose plan places ranks by GPU (:mod:`taas.launch.ray.placement`) holds one placement
group: ``{"GPU": 1}`` per rank, pinned to the planned node's address, ``PACK``.  Its ranks are
no Ray tasks, so the group is what tells the cluster (and other users' jobs, other kernels)
that those GPUs are taken.

The group is given back when the last job holding it ends (and at the launcher's shutdown):
GPUs held between cells would block other work on a shared cluster.  A job that asks for the
same bundles while the group is still held (the next attempt, started before the last one
closed) reuses it.  The price of giving back: GPUs a removed group held return to the cluster
only at its next resource report (~1 s measured), so a cell run right after the previous one
may wait that long for its reservation.
"""

from __future__ import annotations

import threading

from taas.errors import LaunchError

TIMEOUT = 30.0  # seconds to wait for the cluster to reserve the job's GPUs


def bundles(ips: list[str]) -> list[dict]:
    """The placement group's bundles for ranks on the nodes at ``ips`` (one entry per rank)."""
    return [{"GPU": 1, f"node:{ip}": 0.001} for ip in ips]


class Reservation:
    """At most one placement group, held while any job that asked for it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._group = None  # the placement group
        self._bundles: list[dict] | None = None
        self._holders: set[str] = set()  # attempts that hold the group

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
            if self._group is not None and self._bundles == bundles:
                return
            self._remove_locked()
            group = placement_group(bundles, strategy="PACK", name=f"taas-{attempt}")
            if not group.wait(TIMEOUT):
                _remove(group)
                self._holders.discard(attempt)
                raise LaunchError(f"the cluster did not reserve {len(bundles)} GPU(s) in "
                                  f"{TIMEOUT:.0f} s: other work holds them; try again, or use fewer --gpus")
            self._group, self._bundles = group, bundles

    def let_go(self, attempt: str) -> None:
        """``attempt`` ended: the GPUs go back as soon as no job of ours holds them."""
        with self._lock:
            self._holders.discard(attempt)
            if not self._holders:
                self._remove_locked()

    def release(self) -> None:
        """Give the group back whoever holds it (the launcher shuts down)."""
        with self._lock:
            self._holders.clear()
            self._remove_locked()

    def _remove_locked(self) -> None:
        if self._group is not None:
            _remove(self._group)
        self._group, self._bundles = None, None


def _remove(group) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:  # broad: the cluster freed it already (the driver is leaving)
        pass
