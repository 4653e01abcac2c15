"""CUDA in the kernel before a job just works: the kernel never forks ranks (its start process
is a fresh interpreter), and the start process checks before every fork that it has not
initialised CUDA itself (taas.launch.local.forksafe).  On CPU, torch's CUDA calls are harmless;
the check is made to see an initialised CUDA through its test hook."""

from __future__ import annotations

import os
import tempfile

import pytest

from taas.launch.local import forksafe
from tests.support.kernel_driver import Kernel

pytestmark = pytest.mark.kernel

# While this file exists, this module's start processes see CUDA initialised.
_FLAG = os.path.join(tempfile.gettempdir(), f"taas-test-cuda-initialised-{os.getpid()}")


@pytest.fixture(scope="module")
def kernel(workdir):
    """A kernel that imported torch and asked about CUDA before taas was even loaded."""
    k = Kernel(str(workdir), load_taas=False, env={forksafe.TEST_HOOK: _FLAG})
    run = k.run("import torch\ncuda_seen = (torch.cuda.is_available(), torch.cuda.device_count())")
    assert run.error is None, run.traceback
    run = k.run("%load_ext taas")
    assert run.error is None, run.traceback
    yield k
    k.shutdown()
    if os.path.exists(_FLAG):
        os.unlink(_FLAG)


def test_a_kernel_that_asked_about_cuda_runs_its_job(kernel, clean):
    run = kernel.run("#pragma taas --gpus 2\nimport torch.distributed as dist\n"
                     "t = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())")
    assert run.error is None, run.traceback
    assert run.result == "2"


def test_cuda_initialised_in_the_kernel_never_reaches_the_start_process(kernel, clean):
    # What a kernel that ran `model.cuda()` looks like to torch (a CPU machine cannot do it).
    assert kernel.run("torch.cuda.is_initialized = lambda: True").error is None
    run = kernel.run("#pragma taas --gpus 2\nimport torch\nx = torch.cuda.is_initialized()\nx")
    assert run.error is None, run.traceback
    assert run.result == "False"


def test_a_start_process_that_initialised_cuda_refuses_and_the_next_job_works(kernel, clean):
    assert kernel.run("#pragma taas --gpus 1\nx = 1").error is None  # the start process is warm
    open(_FLAG, "w").close()
    try:
        run = kernel.run("#pragma taas --gpus 2\ny = 2")
        assert run.status == "error"
        usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError: ")]
        assert usage == [f"UsageError: {forksafe.REFUSAL}"], run.stderr  # one line, no traceback
        assert kernel.run("y").error is not None  # the cell never ran
    finally:
        os.unlink(_FLAG)
    run = kernel.run("#pragma taas --gpus 2\ny = 2\ny")
    assert run.error is None, run.traceback
    assert run.result == "2"
