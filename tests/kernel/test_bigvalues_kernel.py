"""A big notebook tensor read by a real job: moved to shared memory once, passed to every rank
by descriptor and mapped copy-on-write there; nothing of a job left after it, whether it
succeeded or failed."""

from __future__ import annotations


import pytest

from tests.support.kernel_driver import Kernel, cell
from tests.support.ranks import per_rank

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
    assert "[rank1] rank1 first 1.0" in per_rank(run.stdout)
    after = kernel.run(cell("""
        a = big.data_ptr()
        perms = [line.split()[1] for line in open("/proc/self/maps")
                 if int(line.split("-")[0], 16) <= a < int(line.split()[0].split("-")[1], 16)]
        print(torch.equal(big, torch.arange(16 << 20, dtype=torch.float32)), perms)
    """))
    # the notebook's tensor, unchanged and where it was, now in shared memory
    assert after.stdout.strip() == "True ['rw-s']", after.stdout


def test_the_next_job_gets_the_same_copy_with_the_notebooks_changes(kernel, clean):
    kernel.run("big[0] = -7.0")
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        print("first", big[0].item(), "rest", torch.equal(big[1:], torch.arange(1, 16 << 20, dtype=torch.float32)))
    """))
    assert run.error is None, run.traceback
    assert per_rank(run.stdout).count("first -7.0 rest True") == 2, run.stdout


def test_failed_job_leaves_no_shared_copy(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        total = big[:4].sum()
        raise ValueError("boom after reading big")
    """))
    assert run.error is not None and "boom after reading big" in run.traceback


def test_a_tensor_with_a_numpy_alias_and_the_alias_survive_a_job(kernel, clean):
    """The alias shares the tensor's memory; a job must neither free it nor move it away (the
    first design swapped the storage's pointer and freed the old pages: the kernel crashed)."""
    setup = kernel.run("t2 = torch.arange(16 << 20, dtype=torch.float32)\na2 = t2.numpy()")
    assert setup.error is None, setup.traceback
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        print("sum", float(t2[:5].sum()))
    """))
    assert run.error is None, run.traceback
    assert per_rank(run.stdout).count("sum 10.0") == 2, run.stdout
    after = kernel.run(cell("""
        junk = [torch.ones(16 << 20) for _ in range(3)]  # would reuse freed memory
        a2[0] = 5.0
        print(t2[0].item(), float(a2[1:5].sum()))
        del junk
    """))
    assert after.error is None, after.traceback
    assert after.stdout.strip() == "5.0 10.0"


# The kernel's open /dev/shm files.  Its other threads open and close fds meanwhile (IPython's
# history writer, taas's pumps): an fd gone between listing and reading its link is skipped.
SHARED_FILES = cell("""
    def _shm_fds():
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
            except OSError:
                pass
        return count
    print(_shm_fds())
""")


def test_a_freed_tensors_shared_memory_goes_after_the_cell_that_freed_it(kernel, clean):
    assert kernel.run("import os").error is None
    before = int(kernel.run(SHARED_FILES).stdout)
    kernel.run("t3 = torch.ones(16 << 20)")
    run = kernel.run("#pragma taas --gpus 2\nx = float(t3[:4].sum())")
    assert run.error is None, run.traceback
    assert int(kernel.run(SHARED_FILES).stdout) == before + 1  # t3's file, kept for later jobs
    kernel.run("del t3")
    assert int(kernel.run(SHARED_FILES).stdout) == before  # closed after the cell that freed it


# -- big results back --------------------------------------------------------------------------
RESULT_FILES = cell("""
    import os
    def _result_fds():  # as SHARED_FILES: an fd closed meanwhile is skipped
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += "memfd:taas-result" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return count
    print(_result_fds())
""")


def test_a_big_tensor_and_a_module_come_back_equal_and_usable(kernel, clean):
    before = int(kernel.run(RESULT_FILES).stdout)
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import torch
        torch.manual_seed(0)
        back = torch.arange(32 << 20, dtype=torch.float32)  # 128 MiB
        part = back[5:10]
        net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 16))
        expected = float(net(torch.ones(1, 1024)).sum())
    """))
    assert run.error is None, run.traceback
    after = kernel.run(cell("""
        import io
        s = back.untyped_storage()
        print("equal", torch.equal(back, torch.arange(32 << 20, dtype=torch.float32)), s.resizable(),
              part.untyped_storage().data_ptr() == s.data_ptr())
        back.mul_(2)
        print("usable", float(back[3]), float(part[0]), back.numpy()[4], back[:8].clone().resize_(16).shape[0])
        print("net", abs(float(net(torch.ones(1, 1024)).sum()) - expected) < 1e-4)
        net(torch.ones(2, 1024)).sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        buf = io.BytesIO(); torch.save(net.state_dict(), buf); print("saved", buf.tell() > 8 << 20)
    """))
    assert after.error is None, after.traceback
    assert "equal True True True" in after.stdout
    assert "usable 6.0 10.0 8.0 16" in after.stdout
    assert "net True" in after.stdout and "saved True" in after.stdout
    # read out of rank 0's memory: back's storage and the first layer's weight (the rest inline)
    assert "big results: 2 storages, 0.13 GiB, read from rank 0's memory" in kernel.run("%taas").stdout
    again = kernel.run("#pragma taas --gpus 2\nprint('sum', float(back[:4].sum()))")  # goes out again
    assert again.error is None, again.traceback
    assert per_rank(again.stdout).count("sum 12.0") == 2, again.stdout
    kernel.run("del back, part, s, net")
    assert int(kernel.run(RESULT_FILES).stdout) == before  # the files went with the tensors


def test_a_failed_job_after_binding_a_big_tensor_leaves_nothing(kernel, clean):
    kernel.run("kept = 'before'")
    before = int(kernel.run(RESULT_FILES).stdout)
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import torch
        import torch.distributed as dist
        import time
        kept = torch.ones(16 << 20)  # 64 MiB, sent by rank 0 as a file once its cell ended...
        if dist.get_rank() == 1:
            time.sleep(1.5)  # ...which it has, when rank 1 fails
            raise ValueError("rank 1 fails")
    """))
    assert run.error is not None and "rank 1 fails" in run.traceback
    after = kernel.run(cell("""
        print(repr(kept))
    """))
    assert after.stdout.strip() == "'before'"  # the notebook's namespace as it was
    assert int(kernel.run(RESULT_FILES).stdout) == before


def test_big_results_come_back_by_the_channel_on_the_second_launcher_too(tmp_path):
    """The channel is one more shared fd: a launcher that passes them as they are (the private
    one starts a fresh interpreter per process) carries it unchanged."""
    from tests.support.launchers import kernel_on

    k = kernel_on("private", str(tmp_path))
    try:
        run = k.run("#pragma taas --gpus 2\nimport torch\nback = torch.full((16 << 20,), 3.0)")
        assert run.error is None, run.traceback
        after = k.run("print(float(back.sum()))")
        assert after.stdout.strip() == f"{3.0 * (16 << 20)}", after.stdout
        assert "big results: 1 storage, 0.06 GiB, read from rank 0's memory" in k.run("%taas").stdout
    finally:
        k.shutdown()
