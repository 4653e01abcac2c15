"""A big notebook tensor read by a real job: moved to shared memory once, passed to every rank
by descriptor and mapped copy-on-write there; nothing of a job left after it, whether it
succeeded or failed."""

from __future__ import annotations


import pytest

from tests.kernel_driver import Kernel, cell

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(str(tmp_path_factory.mktemp("notebook")))
    run = k.run("import torch\nbig = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB")
    assert run.error is None, run.traceback
    yield k
    k.shutdown()


def test_rank_writes_to_its_own_copy_only(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import os
        import torch.distributed as dist
        shared = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.environ["TAAS_SHARED_FDS"].split(",")]
        maps = open("/proc/self/maps").read()
        mapped = sorted({line.split()[1] for line in maps.splitlines() if shared[0] in line})
        if dist.get_rank() == 1:
            big.add_(1)  # in place, in rank 1 only
        dist.barrier()
        if dist.get_rank() == 0:
            print("mapped", mapped)
            print("rank0 unchanged", torch.equal(big, torch.arange(16 << 20, dtype=torch.float32)))
        else:
            print("rank1 first", big[0].item())
        dist.barrier()
    """))
    assert run.error is None, run.traceback
    assert "[rank0] mapped ['rw-p']" in run.stdout  # one private mapping of the shared copy
    assert "[rank0] rank0 unchanged True" in run.stdout
    assert "[rank1] rank1 first 1.0" in run.stdout
    after = kernel.run("print(torch.equal(big, torch.arange(16 << 20, dtype=torch.float32)), "
                       "big.untyped_storage()._get_shared_fd() >= 0)")
    assert after.stdout.strip() == "True True"  # the notebook's tensor, now in shared memory


def test_the_next_job_gets_the_same_copy_with_the_notebooks_changes(kernel, clean):
    kernel.run("big[0] = -7.0")
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        print("first", big[0].item(), "rest", torch.equal(big[1:], torch.arange(1, 16 << 20, dtype=torch.float32)))
    """))
    assert run.error is None, run.traceback
    assert run.stdout.count("first -7.0 rest True") == 2, run.stdout


def test_failed_job_leaves_no_shared_copy(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        total = big[:4].sum()
        raise ValueError("boom after reading big")
    """))
    assert run.error is not None and "boom after reading big" in run.traceback
