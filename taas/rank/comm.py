"""Did the ranks talk to each other?  A job whose ranks never did says so.

A cell that runs N ranks but never makes a collective (no DDP, no ``all_reduce``, a library
that did not see the job) trains N independent copies and looks fine.  Each rank counts the
operations on its process groups and reports the count when the cell ends; the kernel
(:func:`note`) prints one line when every rank of a multi-rank job counted zero.

The counter is the process group's *sequence number*, which every collective increments
(measured on gloo: ``barrier``, ``all_reduce``, DDP's construction and backward,
``all_gather_object``, ``broadcast_object_list``, ``send``/``recv``), one per group, including
groups from ``new_group`` and device meshes.  Point-to-point calls are also counted where
they are made (``ProcessGroup.send``/``recv``), since NCCL numbers only collectives.  Groups
the cell destroys are read just before they go.  Rank side: :func:`install` (before the cell,
after taas's own start-up barrier), :func:`report` (after it).  No torch import at module level:
the kernel imports this module for :func:`note`.
"""

from __future__ import annotations

import functools

from taas.launch.process import events

_baseline: dict = {}  # process group -> its sequence number when the cell started
_done = 0  # operations on groups destroyed during the cell, and point-to-point calls
_unknown = False  # a group whose sequence number cannot be read: no claim is made


def install() -> None:
    """Start counting: called once in a rank, after taas's start-up barrier."""
    global _unknown
    try:
        import torch.distributed.distributed_c10d as c10d

        for group in list(c10d._world.pg_map):
            _baseline[group] = _sequence(group)
        _patch_destroy(c10d)
        _patch_point_to_point()
    except Exception:  # torch internals moved: count nothing, claim nothing
        _unknown = True


def count() -> int | None:
    """Operations this rank made on any process group since :func:`install`; None: unknown."""
    import torch.distributed.distributed_c10d as c10d

    live = list(c10d._world.pg_map)
    total = _done + sum(_made(group) for group in live)
    # A group that went away without our destroy_process_group: its count is lost.
    lost = any(group not in live for group in _baseline)
    return None if _unknown or lost else total


def report() -> None:
    """Send this rank's count on the events pipe (never raises: it only informs a note)."""
    try:
        ops = count()
    except Exception:  # torch internals vary by version; the note is informative only
        ops = None
    events.send("comm", ops=ops)


def _sequence(group) -> int | None:
    global _unknown
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a private torch API: absent or refusing on some backends/versions
        _unknown = True
        return None


def _made(group) -> int:
    now = _sequence(group)
    start = _baseline.get(group) or 0
    return max(0, now - start) if now is not None else 0


def _patch_destroy(c10d) -> None:
    original = c10d.destroy_process_group
    if getattr(original, "_taas", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        global _done
        targets = list(c10d._world.pg_map) if group is None or group is c10d.GroupMember.WORLD else [group]
        made = sum(_made(g) for g in targets if g in c10d._world.pg_map)
        result = original(group)
        _done += made
        for g in targets:
            _baseline.pop(g, None)
        return result

    destroy_process_group._taas = True
    c10d.destroy_process_group = destroy_process_group
    import torch.distributed as dist

    dist.destroy_process_group = destroy_process_group


def _patch_point_to_point() -> None:
    from torch._C._distributed_c10d import ProcessGroup

    for name in ("send", "recv", "recv_anysource"):
        original = getattr(ProcessGroup, name, None)
        if original is None or getattr(original, "_taas", False):
            continue
        setattr(ProcessGroup, name, _counted(original))


def _counted(original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        global _done
        _done += 1
        return original(self, *args, **kwargs)

    call._taas = True
    return call


# -- kernel side -------------------------------------------------------------------------------
def note(world: int, ops: dict[str, int | None]) -> str | None:
    """The line to show when a finished job's ``world`` ranks all reported zero operations
    (``ops``: process key -> count, from the ranks' "comm" events); None otherwise."""
    counts = [ops.get(f"rank{r}") for r in range(world)]
    if world < 2 or any(c is None or c > 0 for c in counts):
        return None
    return (f"taas: the {world} ranks never communicated (no collective or send/recv on any "
            "process group): each ran the cell alone. To train together, wrap the model in "
            "DistributedDataParallel (or FSDP) and check that your library sees the job "
            "(e.g. Accelerator().num_processes, TrainingArguments.world_size).")
