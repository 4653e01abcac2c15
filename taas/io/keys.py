"""The names of a job's processes, as a user reads them in output and errors: one spelling.

    rank0, rank1, ...        the ranks (global rank)
    loader:NAME:W            loader worker W of the registered loader NAME
    data-relay:N             the data transport's relay on node N of the job's topology

A key is only a name: what a process *is* travels as fields of its ``ProcessSpec``
(``rank``, ``role``, ``node``).  Pure; nothing here imports anything of taas.
"""

from __future__ import annotations

RANK, LOADER, RELAY = "rank", "loader", "relay"  # ProcessSpec.role


def rank_key(rank: int) -> str:
    return f"rank{rank}"


def loader_key(loader: str, worker: int) -> str:
    return f"loader:{loader}:{worker}"


def relay_key(node: int) -> str:
    return f"data-relay:{node}"


def rank_of(key: str) -> int | None:
    """The global rank a key names, or None for a process that is not a rank."""
    digits = key[len(RANK):]
    return int(digits) if key.startswith(RANK) and digits.isdigit() else None


def is_rank(key: str) -> bool:
    return rank_of(key) is not None


def order(key: str) -> tuple:
    """Sort key: ranks first by number, then the other processes by name and number."""
    digits = "".join(ch for ch in key if ch.isdigit())
    return (not is_rank(key), key.rstrip("0123456789"), int(digits) if digits else 0)
