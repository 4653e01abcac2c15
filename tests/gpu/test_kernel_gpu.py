"""The GPU path through a real Jupyter kernel, when the Jupyter packages are there (the GPU
machine has none unless their wheels were carried: ``tools/gpu-suite.sh --prepare``): the
kernel uses CUDA first (a CUDA model in a plain cell), then a 1-rank NCCL job reads it; the
model arrives on the rank's own GPU, results come back on CPU, nothing is left behind.
"""

from __future__ import annotations

import time

import pytest

from tests.gpu.harness import OFFLINE, cell, gpu_returns_to, gpu_used_bytes, job_shm

pytest.importorskip("jupyter_client", reason="no jupyter_client: carry its wheels (docs/gpu.md)")
pytest.importorskip("ipykernel", reason="no ipykernel: carry its wheels (docs/gpu.md)")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from tests.support.kernel_driver import Kernel

    k = Kernel(str(tmp_path_factory.mktemp("notebook")), env=OFFLINE)
    yield k
    k.shutdown()


def test_cuda_in_the_kernel_first_then_a_nccl_job_through_a_real_kernel(kernel):
    before = kernel.run(cell("""
        import torch
        model = torch.nn.Linear(256, 256).cuda()
        print(torch.cuda.is_initialized(), next(model.parameters()).device)
        """))
    assert before.error is None, before.traceback
    assert before.stdout.split() == ["True", "cuda:0"]
    baseline = gpu_used_bytes()  # the kernel's context and model included
    run = kernel.run(cell("""
        %%taas --gpus 1
        import torch, torch.distributed as dist
        t = torch.ones(2, device="cuda")
        dist.all_reduce(t)
        print("rank", dist.get_backend(), next(model.parameters()).device, t.tolist())
        out = model(torch.ones(1, 256, device="cuda"))
        """))
    assert run.error is None, run.traceback
    assert "rank nccl cuda:0 [1.0, 1.0]" in run.stdout, run.stdout + run.stderr
    back = kernel.run("print(out.device, t.device, next(model.parameters()).device)")
    assert back.stdout.split() == ["cpu", "cpu", "cuda:0"], back.stdout  # results on CPU; the kernel's model stays
    ids = kernel.run("import taas as _t; print(','.join(_t._loaded['session'].job_ids))").stdout.strip().split(",")
    deadline = time.monotonic() + 5
    while job_shm(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job_shm(ids) == []
    assert gpu_returns_to(baseline) <= 256 << 20
