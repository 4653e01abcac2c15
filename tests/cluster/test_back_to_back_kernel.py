"""Cells run back to back on the simulated cluster, as Run All sends them: every request is
queued in the kernel before the first ends, so each cell starts the moment the last one returns
(fresh ranks each time, on the warm agents).  Each must run whole; the timing is
benchmarks/cluster_launch.py's (back to back against after a pause), not asserted here."""

from __future__ import annotations

import pytest

from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.cluster_helpers import job_processes, placement_groups_left
from tests.support.kernel_driver import cell, cmdline, wait_until_gone

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]


def test_three_cells_run_back_to_back_each_whole(kernel, ray_cluster):
    cells = [cell(f"""
        %%taas --gpus 4
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + {i})])
        dist.all_reduce(t)
        total{i} = t.item()
        """) for i in range(3)]
    sent = [kernel.execute(code) for code in cells]  # all queued at once, as Run All does
    replies = [kernel.reply(msg_id)["content"] for msg_id in sent]
    assert [r["status"] for r in replies] == ["ok"] * 3, [(r.get("ename"), r.get("evalue")) for r in replies]
    seen = kernel.run("print(total0, total1, total2)")
    assert seen.error is None, seen.traceback
    assert seen.stdout.split() == ["6.0", "10.0", "14.0"]  # ranks 0..3 summed, plus 4 x the cell's i
    assert wait_until_gone([p.pid for p in job_processes(ray_cluster)], timeout=30) == [], \
        [cmdline(p) for p in job_processes(ray_cluster)]
    assert placement_groups_left(ray_cluster) == "0"  # the last cell gave its GPUs back too
