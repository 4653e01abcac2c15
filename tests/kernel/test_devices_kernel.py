"""Where values land, through a real kernel (CPU here; tests/gpu/test_values_gpu.py on CUDA):
notebook tensors arrive with their storages shared (views stay views, tied weights stay tied);
results come back on the CPU, with or without ``--results-device keep`` when the kernel has no
GPU; a bad ``--results-device`` is a one-line UsageError."""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import cell, one_line_usage_error
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel

NOTEBOOK = cell("""
    import torch, torch.nn as nn
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
    base = torch.arange(10.0)
    view = base[2:]
    tied = Tied()
""")


def test_notebook_values_arrive_shared_and_results_come_back_on_cpu(kernel, clean):
    setup = kernel.run(NOTEBOOK)
    assert setup.error is None, setup.traceback
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import torch.distributed as dist
        same = view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        print("shared", same, "tied", tied.head.weight is tied.embed.weight, "on", base.device)
        model = Tied()
        pair = {"w": model.embed.weight, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
        model.embed.weight[0] if False else torch.full((2,), float(dist.get_rank()))
    """))
    assert run.error is None, run.traceback
    assert per_rank(run.stdout).count("shared True tied True on cpu") == 2, run.stdout
    check = kernel.run(cell("""
        out = _
        print(model.embed.weight.device, pair["w"].device, out.device, out.tolist(),
              model.head.weight is model.embed.weight,
              pair["opt"].param_groups[0]["params"][0].device)
    """))
    assert check.error is None, check.traceback
    assert check.stdout.strip() == "cpu cpu cpu [0.0, 0.0] True cpu", check.stdout


def test_results_device_keep_without_a_gpu_comes_back_on_cpu(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 1 --results-device keep
        import torch
        kept = torch.ones(3)
    """))
    assert run.error is None, run.traceback
    check = kernel.run("print(kept.device, kept.tolist())")
    assert check.stdout.strip() == "cpu [1.0, 1.0, 1.0]", check.stdout + check.stderr


def test_a_bad_results_device_is_a_one_line_usage_error(kernel):
    run = kernel.run("%%taas --results-device gpu\nnever = 1")
    line = one_line_usage_error(run)
    assert line == ("UsageError: --results-device: invalid choice: 'gpu' (choose from 'cpu', 'keep'); "
                    "see %%taas? for the options"), line
    assert kernel.run("print('never' in globals())").stdout.strip() == "False"
