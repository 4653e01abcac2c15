"""taas.rank.patches: notebook code written for one process behaves inside a rank.

Each test runs in a forked child (the patches replace torch functions and classes for good),
as a one-rank gloo job over a file store, the way a rank starts on CPU: the default group is
already up when the cell runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from taas.rank import patches
from tests.support.forks import no_leftover_children, run_with_events  # noqa: F401 (an autouse fixture)

NOTE = "taas: nn.DataParallel inside a rank runs as DistributedDataParallel over the job's ranks"


def in_a_rank(tmp_path, cell) -> str:
    """Run ``cell()`` in a patched one-rank CPU job; its stdout and stderr (AssertionErrors fail
    the test)."""
    store = tmp_path / "store"

    def body() -> int:
        import sys

        sys.stdout = sys.stderr  # the DataParallel note is on the rank's stdout: read with stderr
        patches.install("cpu")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        cell()
        return 0

    run = run_with_events(body)
    assert run.code == 0, run.stderr
    return run.stderr


def test_data_parallel_becomes_ddp_over_the_job_with_one_note(tmp_path):
    def cell():
        model = nn.DataParallel(nn.Linear(3, 1))
        assert isinstance(model, DistributedDataParallel), type(model)
        assert isinstance(model, nn.DataParallel)  # the name the cell used still checks
        model(torch.ones(4, 3)).sum().backward()  # trains as DDP: gradients reduced over the job
        assert model.module.weight.grad is not None
        nn.DataParallel(nn.Linear(2, 2))  # a second one: no second note

    stderr = in_a_rank(tmp_path, cell)
    assert stderr.count(NOTE) == 1, stderr


def test_every_name_of_data_parallel_is_the_patched_one(tmp_path):
    def cell():
        import torch.nn.parallel as parallel
        import torch.nn.parallel.data_parallel as data_parallel

        assert nn.DataParallel is parallel.DataParallel is data_parallel.DataParallel
        assert issubclass(nn.DataParallel, DistributedDataParallel)

    in_a_rank(tmp_path, cell)


def test_init_process_group_again_is_a_no_op_and_nccl_becomes_gloo_on_cpu(tmp_path):
    store2 = tmp_path / "store2"

    def cell():
        group = dist.group.WORLD
        # A DataSphere cell's own call, with the group already up: nothing happens.
        assert dist.init_process_group(backend="nccl", init_method="env://") is None
        assert dist.group.WORLD is group and dist.get_backend() == "gloo"
        dist.destroy_process_group()
        # After the cell's own destroy, a new call initialises again, on gloo (CPU job).
        dist.init_process_group(backend="nccl", init_method=f"file://{store2}", rank=0, world_size=1)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0

    assert NOTE not in in_a_rank(tmp_path, cell)


def test_installing_twice_patches_once(tmp_path):
    def cell():
        first = dist.init_process_group
        patches.install("cpu")
        assert dist.init_process_group is first  # not wrapped again

    in_a_rank(tmp_path, cell)
