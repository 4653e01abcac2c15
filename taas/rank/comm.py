"""Did the ranks talk to each other?  A job whose ranks trained but never did says so.

A cell that runs N ranks but never makes a collective (no DDP, no ``all_reduce``, a library
that did not see the job) trains N independent copies and looks fine.  Each rank counts the
operations on its process groups, and its training (backward passes and optimizer steps), and
reports both when the cell ends; the kernel (:func:`note`) prints one line when ranks of a
multi-rank job trained and every rank counted zero operations.  A cell that only prints,
plots or reads a registered loader never trains: it gets no note (a warning that fires on
ordinary cells teaches people to ignore it).

Training is counted by global hooks installed once per process: ``torch.autograd.backward``
wrapped (``Tensor.backward`` calls it by that name) and an optimizer step post-hook
(``register_optimizer_step_post_hook``, run after every ``Optimizer.step``).  Each costs one
Python call per backward pass or step.

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
# Backward passes and optimizer steps since install; None: the hooks could not be installed.
_trained: dict[str, int] | None = {"backward": 0, "steps": 0}
_step_hook = None  # the optimizer step post-hook's handle: installed once per process


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
    _count_training()


def trained() -> dict[str, int] | None:
    """Backward passes and optimizer steps this rank made since :func:`install`; None: unknown."""
    return None if _trained is None else dict(_trained)


def count() -> int | None:
    """Operations this rank made on any process group since :func:`install`; None: unknown."""
    import torch.distributed.distributed_c10d as c10d

    live = list(c10d._world.pg_map)
    total = _done + sum(_made(group) for group in live)
    # A group that went away without our destroy_process_group: its count is lost.
    lost = any(group not in live for group in _baseline)
    return None if _unknown or lost else total


def report() -> None:
    """Send this rank's counts on the events pipe (never raises: it only informs a note)."""
    events.send("comm", **counts())


def counts() -> dict:
    """This rank's counts now, the fields of its ``comm`` event (never raises).  Training
    counts that are zero are left out (the kernel reads a missing one as 0)."""
    try:
        ops = count()
    except Exception:  # torch internals vary by version; the note is informative only
        ops = None
    training = trained()
    extra: dict = ({"backward": None, "steps": None} if training is None
                   else {k: v for k, v in training.items() if v})
    return {"ops": ops, **extra}


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


def _count_training() -> None:
    """Install the training counters (once per process; see the module's docstring)."""
    global _trained, _step_hook
    if _trained is not None:  # counts start at install (a rank kept for the next cell too)
        _trained.update(backward=0, steps=0)
    try:
        import torch.autograd
        from torch.optim.optimizer import register_optimizer_step_post_hook

        original = torch.autograd.backward
        if not getattr(original, "_taas", False):
            @functools.wraps(original)
            def backward(*args, **kwargs):
                if _trained is not None:
                    _trained["backward"] += 1
                return original(*args, **kwargs)

            backward._taas = True  # type: ignore[attr-defined]
            torch.autograd.backward = backward
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_stepped)
    except Exception:  # torch moved these: no claim about training, so no note
        _trained = None


def _stepped(optimizer, args, kwargs) -> None:
    if _trained is not None:
        _trained["steps"] += 1


# -- kernel side -------------------------------------------------------------------------------
def note(world: int, ops: dict[str, int | None],
         trained: dict[str, dict[str, int | None]] | None = None) -> str | None:
    """The line to show when a finished job's ``world`` ranks all reported zero operations
    (``ops``: process key -> count, from the ranks' "comm" events) and trained; None otherwise.

    ``trained``: process key -> ``{"backward": n, "steps": m}`` (None for a count a rank could
    not make).  The note needs some rank to have made a backward pass or an optimizer step; a
    caller that passes no ``trained`` at all asks about the operations only."""
    counts = [ops.get(f"rank{r}") for r in range(world)]
    if world < 2 or any(c is None or c > 0 for c in counts):
        return None
    what = ""
    if trained is not None:
        ranks = [trained.get(f"rank{r}") or {} for r in range(world)]
        backward = sum(t.get("backward") or 0 for t in ranks)
        steps = sum(t.get("steps") or 0 for t in ranks)
        if not backward and not steps:
            return None  # no rank trained: printing, plotting, loading alone need no collective
        what = f" while they trained ({_counted_training(backward, steps)} in all)"
    return (f"taas: the {world} ranks never communicated (no collective or send/recv on any "
            f"process group){what}: each ran the cell alone. To train together, wrap the model "
            "in DistributedDataParallel (or FSDP) and check that your library sees the job "
            "(e.g. Accelerator().num_processes, TrainingArguments.world_size).")


def _counted_training(backward: int, steps: int) -> str:
    parts = []
    if backward:
        parts.append(f"{backward} backward pass{'es' * (backward != 1)}")
    if steps:
        parts.append(f"{steps} optimizer step{'s' * (steps != 1)}")
    return " and ".join(parts)
