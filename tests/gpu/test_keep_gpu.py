"""Kept ranks on a real GPU (issue 16): a model built on the GPU in a kept NCCL cell stays there
for the next cell, ``%taas`` shows the GPU memory each rank's tensors hold, and ``%taas
release`` gives that memory back.  Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

from taas import status


def test_a_model_kept_on_the_gpu_is_used_by_the_next_cell_and_shown_by_taas(session, run, clean):
    build = run("""
        import torch, torch.distributed as dist
        net = torch.nn.Linear(4096, 4096).cuda()  # 64 MiB of parameters on the rank's GPU
        """, "--gpus 1 --keep").ok()
    assert session.kept is not None, build.text
    line = status.render(session)
    assert "GPU memory (torch, after the last cell) rank0 " in line, line
    shown = int(line.split("GPU memory (torch, after the last cell) rank0 ")[1].split(" MiB")[0])
    assert 64 <= shown < 1024, line  # the model's 64 MiB, not more than a little above it

    pids = session.kept.handle.running_pids()
    used = run("""
        out = net(torch.ones(1, 4096, device="cuda"))
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        same = str(next(net.parameters()).device), dist.get_backend(), t.item()
        """).ok()
    assert used.values["same"] == ("cuda:0", "nccl", 1.0), used.text
    assert session.kept.handle.running_pids() == pids  # the same rank, its model still there
    session.release()
    assert session.kept is None
