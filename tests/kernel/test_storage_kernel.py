"""--storage through a real kernel: what ranks > 0 write comes back (layer), or fails with a
one-line hint (strict), or goes straight to the directory (shared); no mount or layer is left."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.kernel_driver import OFFLINE, cell, plain
from tests.support.ranks import per_rank
from tests.support.launchers import LOCAL, on_both_launchers
from tests.support.notebooks import tiny_bert_notebook

pytestmark = pytest.mark.kernel


KERNEL_ENV = OFFLINE  # the module's kernel (tests/conftest.py) runs offline


@pytest.fixture
def unchanged(kernel, kernel_launcher):
    """The kernel's mount table is the same after the test's jobs (no mount leaked from a rank's
    namespace), and the last job's directory, with its layers, is gone.  Checked on the local
    launcher only: both are about its namespaces and job directory, which a second launcher
    (tests/support/launchers.py) need not have."""
    if kernel_launcher != LOCAL:
        yield
        return
    def mounts():
        run = kernel.run("print(open('/proc/self/mountinfo').read(), end='')")
        assert run.error is None, run.traceback
        return run.stdout

    before = mounts()
    yield
    assert mounts() == before
    left = kernel.run("import glob, tempfile, taas\n"
                      "print(glob.glob(f'{tempfile.gettempdir()}/taas-{taas._loaded[\"session\"].last.job_id}-*'))")
    assert left.stdout.strip() == "[]", left.stdout + left.traceback


@on_both_launchers
def test_every_rank_writes_its_own_files_and_they_all_come_back(kernel, clean, unchanged, workdir):
    run = kernel.run(cell("""
        #pragma taas --gpus 3
        import os, torch, torch.distributed as dist
        rank = int(os.environ["RANK"])
        dist.barrier()
        os.makedirs("ckpt-1", exist_ok=True)
        torch.save(torch.get_rng_state(), f"ckpt-1/rng_state_{rank}.pth")
        if rank == 1:  # a rank sees its own writes
            with open("ckpt-1/rng_state_1.pth", "rb") as f:
                print("reads back", len(f.read()) > 0)
        """))
    assert run.error is None, run.traceback
    assert sorted(os.listdir(workdir / "ckpt-1")) == [f"rng_state_{r}.pth" for r in range(3)]
    assert "conflicts" not in run.stderr and "deleted" not in run.stderr, run.stderr
    assert "[rank1] reads back True" in run.stdout
    assert not (workdir / ".taas").exists()


def test_what_rank_zero_prepares_before_a_barrier_every_rank_reads(kernel, clean, unchanged, workdir):
    """torchrun's usual pattern under the default layer: rank 0 writes, barrier, all read."""
    run = kernel.run(cell("""
        #pragma taas --gpus 3
        import os, torch.distributed as dist
        if dist.get_rank() == 0:
            with open("prepared.txt", "w") as f:
                f.write("ready")
        dist.barrier()
        print(open("prepared.txt").read(), sorted(n for n in os.listdir(".") if n == "prepared.txt"))
        """))
    assert run.error is None, run.traceback
    assert per_rank(run.stdout).count("ready ['prepared.txt']") == 3, run.stdout
    assert (workdir / "prepared.txt").read_text() == "ready"
    assert "conflict" not in run.stderr and "differently" not in run.stderr, run.stderr


def test_two_ranks_writing_one_path_differently_is_one_conflict_line(kernel, clean, unchanged, workdir):
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import os
        with open("shared.log", "w") as f:
            f.write(f"written by rank {os.environ['RANK']}")
        with open("same.txt", "w") as f:
            f.write("the same everywhere")
        """))
    assert run.error is None, run.traceback
    lines = [line for line in plain(run.stderr).splitlines() if "shared.log" in line]
    assert len(lines) == 1, run.stderr
    job = re.search(r"\.taas/conflicts/([0-9a-f]+)/", lines[0]).group(1)
    assert "rank1" in lines[0] and "same.txt" not in run.stderr
    assert (workdir / "shared.log").read_text() == "written by rank 0"
    assert (workdir / ".taas" / "conflicts" / job / "rank1" / "shared.log").read_text() == "written by rank 1"
    assert (workdir / "same.txt").read_text() == "the same everywhere"


def test_strict_refuses_rank_one_with_a_one_line_hint(kernel, clean, unchanged, workdir):
    run = kernel.run(cell("""
        #pragma taas --gpus 2 --storage strict
        import os
        with open(f"strict-{os.environ['RANK']}.txt", "w") as f:
            f.write("x")
        """))
    assert run.error is not None
    text = plain(run.traceback)
    assert "rank1 failed: OSError: [Errno 30] Read-only file system: 'strict-1.txt'" in text, text
    hint = [line for line in text.splitlines() if "--storage strict" in line]
    assert hint == ["taas: the working directory is read-only for ranks other than 0 under --storage "
                    "strict: write from rank 0, to this rank's scratch directory ($TAAS_SCRATCH), "
                    "or use --storage layer"], text
    assert not (workdir / "strict-1.txt").exists()


def test_an_erofs_outside_the_working_directory_gets_no_hint(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 2 --storage strict
        import errno, os
        if os.environ["RANK"] == "1":
            raise OSError(errno.EROFS, "Read-only file system", "/elsewhere/file")
        """))
    assert run.error is not None and "Read-only file system" in plain(run.traceback)
    assert "--storage" not in plain(run.traceback)


def test_shared_lets_every_rank_write_the_directory_itself(kernel, clean, unchanged, workdir):
    run = kernel.run(cell("""
        #pragma taas --gpus 2 --storage shared
        import os
        with open(f"shared-{os.environ['RANK']}.txt", "w") as f:
            f.write("x")
        print("mounts", open("/proc/self/mountinfo").read().count("\\n"))
        """))
    assert run.error is None, run.traceback
    counts = set(re.findall(r"\] mounts (\d+)", run.stdout))
    assert len(counts) == 1, run.stdout  # no rank has a mount of its own
    assert (workdir / "shared-0.txt").exists() and (workdir / "shared-1.txt").exists()


def test_a_bad_storage_value_is_a_one_line_usage_error(kernel):
    run = kernel.run("%%taas --gpus 2 --storage private\npass")
    assert run.stderr == ("UsageError: --storage: invalid choice: 'private' (choose from 'layer', "
                          "'strict', 'shared'); see %%taas? for the options\n")


def test_trainer_default_checkpointing_writes_every_ranks_rng_state(kernel, clean, unchanged, workdir):
    setup = kernel.run(tiny_bert_notebook("hf-ckpt", use_cpu=True, save_strategy="steps", save_steps=2))
    assert setup.error is None, setup.traceback
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        Trainer(model, args, train_dataset=ds).train()
        """))
    assert run.error is None, run.traceback
    assert "Read-only" not in run.stderr and "conflict" not in run.stderr, run.stderr
    for step in ("checkpoint-2", "checkpoint-4"):
        files = os.listdir(workdir / "hf-ckpt" / step)
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(files), files
