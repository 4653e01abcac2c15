"""taas.rank.comm: each rank counts its collectives; the kernel notes ranks that never talked.

The counting runs in forked children (a process group, patched torch functions: nothing of it
may stay in the test session), as one or two gloo ranks over a file store in ``tmp_path``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from taas.rank import comm
from tests.support.forks import exit_code, fork, no_leftover_children, run_with_events  # noqa: F401 (an autouse fixture)


# -- the kernel's note ---------------------------------------------------------------------------
def test_ranks_that_all_counted_zero_get_the_never_communicated_note():
    line = comm.note(2, {"rank0": 0, "rank1": 0})
    assert line.startswith("taas: the 2 ranks never communicated") and "\n" not in line
    assert "DistributedDataParallel" in line


@pytest.mark.parametrize("world, ops", [
    (2, {"rank0": 0, "rank1": 1}),     # one rank talked: they communicated
    (2, {"rank0": 0, "rank1": None}),  # a rank could not count: no claim
    (2, {"rank0": 0}),                 # a rank never reported: no claim
    (1, {"rank0": 0}),                 # one rank has nobody to talk to
    (2, {"rank0": 5, "rank1": 5, "loader-x-0": 0}),  # other processes' counts do not matter
])
def test_no_note_unless_every_rank_counted_zero(world, ops):
    assert comm.note(world, ops) is None


def test_loader_processes_reporting_zero_do_not_stop_the_note():
    assert comm.note(2, {"rank0": 0, "rank1": 0, "loader-x-0": 7}) is not None


# -- a rank's count ------------------------------------------------------------------------------
def rank_body(store: str, rank: int, world: int, cell) -> int:
    """A gloo rank that installs the counter after a start-up barrier (as taas does), runs
    ``cell()``, and reports its count."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dist.barrier()  # taas's own start-up barrier: before install, not counted
    comm.install()
    cell()
    comm.report()
    return 0


def counted(tmp_path, cell, world: int = 1) -> list[dict]:
    """The "comm" events of ``world`` ranks running ``cell`` (rank 0's first)."""
    store = str(tmp_path / "store")
    others = [fork(lambda r=r: (os.environ.pop("TAAS_EVENTS_FD", None),
                                rank_body(store, r, world, cell))[1]) for r in range(1, world)]
    run = run_with_events(lambda: rank_body(store, 0, world, cell))
    assert run.code == 0, run.stderr
    assert all(exit_code(pid) == 0 for pid in others)
    return run.events


def test_a_cell_without_collectives_counts_zero(tmp_path):
    assert counted(tmp_path, lambda: torch.ones(3).sum()) == [{"kind": "comm", "ops": 0}]


def test_collectives_are_counted(tmp_path):
    def cell():
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.barrier()
        dist.broadcast(t, src=0)

    assert counted(tmp_path, cell, world=2) == [{"kind": "comm", "ops": 3}]


def test_a_new_group_counts_and_a_destroyed_one_keeps_its_count(tmp_path):
    def cell():
        group = dist.new_group([0])
        dist.all_reduce(torch.ones(1), group=group)
        dist.all_reduce(torch.ones(1), group=group)
        dist.destroy_process_group(group)  # read just before it goes

    assert counted(tmp_path, cell) == [{"kind": "comm", "ops": 2}]


def test_the_count_survives_destroying_the_default_group(tmp_path):
    def cell():
        dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()

    (event,) = counted(tmp_path, cell)
    assert event == {"kind": "comm", "ops": 1}


def test_point_to_point_calls_are_counted(tmp_path):
    def cell():
        t = torch.zeros(2)
        if dist.get_rank() == 0:
            dist.send(torch.ones(2), dst=1)
        else:
            dist.recv(t, src=0)

    (event,) = counted(tmp_path, cell, world=2)
    # Counted at least once (gloo numbers it as well as the patched call: the note only asks
    # "zero or not").
    assert event["ops"] is not None and event["ops"] >= 1, event


# -- training: the note needs ranks that trained -----------------------------------------------
def test_ranks_that_did_not_train_get_no_note():
    idle = {"backward": 0, "steps": 0}
    assert comm.note(2, {"rank0": 0, "rank1": 0}, {"rank0": idle, "rank1": idle}) is None
    assert comm.note(2, {"rank0": 0, "rank1": 0}, {}) is None  # no rank said it trained


def test_ranks_that_trained_alone_get_the_note_with_what_they_did():
    trained = {"rank0": {"backward": 3, "steps": 3}, "rank1": {"backward": 3, "steps": None}}
    line = comm.note(2, {"rank0": 0, "rank1": 0}, trained)
    assert line is not None and line.startswith("taas: the 2 ranks never communicated")
    assert "while they trained (6 backward passes and 3 optimizer steps in all)" in line
    assert "\n" not in line


def test_ranks_that_trained_and_communicated_get_no_note():
    trained = {"rank0": {"backward": 3, "steps": 3}, "rank1": {"backward": 3, "steps": 3}}
    assert comm.note(2, {"rank0": 7, "rank1": 7}, trained) is None


def train_steps(model, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()


def test_a_print_only_cell_reports_no_training(tmp_path):
    (event,) = counted(tmp_path, lambda: print("only printing"), world=2)
    assert event == {"kind": "comm", "ops": 0}
    assert comm.note(2, {"rank0": 0, "rank1": 0}, {"rank0": {}, "rank1": {}}) is None


def test_training_without_collectives_is_counted_and_noted(tmp_path):
    (event,) = counted(tmp_path, lambda: train_steps(torch.nn.Linear(3, 1)), world=2)
    assert event == {"kind": "comm", "ops": 0, "backward": 2, "steps": 2}
    both = {"rank0": {"backward": 2, "steps": 2}, "rank1": {"backward": 2, "steps": 2}}
    assert comm.note(2, {"rank0": 0, "rank1": 0}, both) is not None


def test_training_with_ddp_counts_collectives_too(tmp_path):
    def cell():
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_steps(DDP(torch.nn.Linear(3, 1)))

    (event,) = counted(tmp_path, cell, world=2)
    assert event["ops"] and event["ops"] > 0 and event["backward"] == 2 and event["steps"] == 2
    both = {"rank0": {"backward": 2, "steps": 2}, "rank1": {"backward": 2, "steps": 2}}
    assert comm.note(2, {"rank0": event["ops"], "rank1": event["ops"]}, both) is None


def test_tensor_backward_and_autograd_backward_both_count_once(tmp_path):
    def cell():
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        torch.autograd.backward((x * 3).sum())

    (event,) = counted(tmp_path, cell)
    assert event == {"kind": "comm", "ops": 0, "backward": 2}
