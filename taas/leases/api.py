"""The leases' contract, as plain data: a GPU seen, who holds a lease, who waits, a decision.

A GPU is known by its UUID (``GPU-...``, as NVML and ``CUDA_VISIBLE_DEVICES`` spell it), never
by an index alone: indices change with ``CUDA_VISIBLE_DEVICES`` and between containers.  A
lease is a lock on one file per GPU in a shared directory (:mod:`taas.leases.locks`); a record
of its holder is written beside the lock but only trusted while the lock is held, so a record
that a dead process left is never believed.
"""

from __future__ import annotations

from dataclasses import dataclass

# A GPU whose memory other programs use above this many MiB counts as busy outside taas
# (TAAS_GPU_BUSY_MIB overrides it): a CUDA context alone is about 500 MiB.
BUSY_MIB = 1024


@dataclass(frozen=True)
class Gpu:
    """One GPU the ranks could use: its UUID, its index as the ranks would see it (the place
    in ``CUDA_VISIBLE_DEVICES``, or the machine's index), and the memory other programs use."""

    uuid: str
    index: int
    used_mib: int = 0  # by programs other than this process (NVML); 0 when unknown


@dataclass(frozen=True)
class Holder:
    """Who holds (or waits for) GPUs: a job, its user, since when (epoch seconds), from which
    notebook when known, and the process that wrote it."""

    job: str
    user: str = "?"
    since: float = 0.0
    notebook: str = ""
    pid: int = 0

    def as_dict(self) -> dict:
        return {"job": self.job, "user": self.user, "since": self.since,
                "notebook": self.notebook, "pid": self.pid}

    @classmethod
    def from_dict(cls, data) -> Holder:
        """The holder in a record; an unreadable one is an unknown holder, never an error."""
        if not isinstance(data, dict):
            return cls("?")
        def text(key: str, default: str = "") -> str:
            value = data.get(key, default)
            return value if isinstance(value, str) else default
        since, pid = data.get("since", 0.0), data.get("pid", 0)
        return cls(text("job", "?")[:64] or "?", text("user", "?")[:64] or "?",
                   float(since) if isinstance(since, (int, float)) else 0.0,
                   text("notebook")[:200], pid if isinstance(pid, int) else 0)


@dataclass(frozen=True)
class Ticket:
    """A live request in line: its name (orders first come, first served), how many GPUs it
    wants, and who asks."""

    name: str
    count: int
    holder: Holder


@dataclass(frozen=True)
class Take:
    """Lease these GPUs (UUIDs, lowest index first), all of them or none."""

    uuids: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Not now: ``place`` in line (1: next), and why (free GPUs, what holds the others)."""

    place: int
    free: int
    held: tuple[tuple[Gpu, Holder], ...]  # GPUs leased through taas, and by whom
    busy: tuple[Gpu, ...]  # GPUs busy outside taas
    ahead: int  # requests ahead of this one


Decision = Take | Wait
