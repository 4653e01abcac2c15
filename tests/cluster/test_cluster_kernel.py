"""A taas cell across machines, through a real kernel: the kernel runs inside the simulated
cluster's namespace (tests/support/cluster.py: a head, GPU-like nodes 127.0.1.1 and 127.0.1.2, a CPU
node 127.0.2.1) and connects with ``%taas cluster``; ranks spread over both GPU nodes."""

from __future__ import annotations

import re
import time

import pytest

from tests.support.cluster_helpers import (LOADER_CELL, LOADER_SETUP, agents, agents_of, connected_kernel,
                                          job_processes, placement_groups_left, relays, sleeping_job)
from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.kernel_driver import Replies, cell, cmdline, plain, wait_until_gone
from tests.support.ranks import per_rank

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]


def test_percent_taas_shows_the_cluster(kernel, ray_cluster):
    run = kernel.run("%taas")
    assert run.error is None, run.traceback
    text = run.stdout
    for ip in ray_cluster.gpu_node_ips:
        assert ip in text, text
    assert "GPU" in text and "CPU" in text, text


def test_ranks_spread_over_both_gpu_nodes_with_torchruns_environment(kernel, ray_cluster):
    run = kernel.run(cell("""
        %%taas --gpus 4
        import os, socket, torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK",
                                          "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TAAS_NODE_ID")}
        print("where", env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["LOCAL_WORLD_SIZE"],
              env["TAAS_NODE_ID"][:8], t.item(), flush=True)
        total = t.item()
        """))
    assert run.error is None, run.traceback
    rows = {int(r): (int(lr), int(g), int(lw), node, float(s))
            for r, lr, g, lw, node, s in re.findall(r"where (\d) (\d) (\d) (\d) (\w+) ([\d.]+)", run.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], run.stdout
    assert [rows[r][:3] for r in range(4)] == [(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)], rows
    assert rows[0][3] == rows[1][3] != rows[2][3] == rows[3][3], rows  # two nodes, two ranks each
    assert all(row[4] == 10.0 for row in rows.values())
    assert all(f"[rank{r}] where" in run.stdout for r in range(4))
    assert kernel.run("print(total)").stdout.strip() == "10.0"
    assert "no CUDA device" in run.stdout  # "GPU" nodes without CUDA: gloo, with the one line


def test_pdb_and_input_in_a_rank_on_the_second_node_read_the_notebooks_input_box(kernel):
    """The stdin wire through the node's agent: rank 2 (on the second GPU node) stops at a
    breakpoint while the others wait in all_reduce; p, then c; then input() there."""
    pdb = "(Pdb) [rank2] "
    run = kernel.run(cell("""
        %%taas --gpus 4
        import torch, torch.distributed as dist
        x = torch.ones(1) * dist.get_rank()
        if dist.get_rank() == 2:
            breakpoint()
        dist.all_reduce(x)
        word = input('word? ') if dist.get_rank() == 2 else None
        print('sum', x.item(), word)
        """), replies=Replies((pdb, "p x * 10"), (pdb, "c"), ("[rank2] word? ", "far")))
    assert run.error is None, run.stderr + run.traceback
    assert run.prompts == [pdb, pdb, "[rank2] word? "]
    assert "[rank2] tensor([20.])" in run.before_prompt[1]
    assert "[rank2] sum 6.0 far" in run.stdout and "sum 6.0 None" in run.stdout, run.stdout


def test_a_big_notebook_tensor_reaches_ranks_on_both_nodes_and_stays_the_notebooks(kernel):
    """A 40 MiB tensor moves to shared memory in the kernel (taas.job.memory.resident) and its bytes go
    to each node by the launcher; a rank writing to it changes only its own copy."""
    made = kernel.run("import torch\nbig = torch.arange(10 << 20, dtype=torch.float32)")
    assert made.error is None, made.traceback
    for _ in range(2):  # the second job: the resident file again, no move
        run = kernel.run(cell("""
            %%taas --gpus 4
            import torch.distributed as dist
            print("big", float(big[:10].sum()), float(big[-1]), flush=True)
            big.add_(1)
            """))
        assert run.error is None, run.traceback
        assert per_rank(run.stdout).count(f"big 45.0 {float((10 << 20) - 1)}") == 4, run.stdout
    after = kernel.run("print(torch.equal(big, torch.arange(10 << 20, dtype=torch.float32)))")
    assert after.stdout.strip() == "True"


def test_a_failing_rank_on_the_second_node_is_the_root_cause(kernel):
    run = kernel.run(cell("""
        %%taas --gpus 4
        import os, torch.distributed as dist
        if os.environ["RANK"] == "3":
            raise ValueError("rank three broke on node " + os.environ["GROUP_RANK"])
        dist.barrier()
        """))
    assert run.status == "error"
    tb = plain(run.traceback)
    assert tb.splitlines()[0].startswith("rank3 failed: ValueError: rank three broke on node 1"), tb
    assert "rank0: stopped after rank3 failed" in tb


def test_interrupt_stops_ranks_on_every_node_within_5s(kernel, ray_cluster):
    seen = {}

    def on_output(out):
        if all(f"[rank{r}] up" in per_rank(out.stdout) for r in range(4)) and "at" not in seen:
            seen["at"] = time.monotonic()
            kernel.km.interrupt_kernel()

    run = kernel.run("%%taas --gpus 4\nimport time\nprint('up', flush=True)\ntime.sleep(600)",
                     on_output=on_output)
    assert "at" in seen, run.stdout + run.stderr
    assert run.status == "error" and run.error["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - seen["at"] < 5
    assert wait_until_gone([p.pid for p in job_processes(ray_cluster)], timeout=10) == []


def test_rank_zeros_file_is_in_the_working_directory(kernel):
    run = kernel.run(cell("""
        %%taas --gpus 4
        import torch, torch.distributed as dist
        if dist.get_rank() == 0:
            torch.save({"w": torch.arange(3)}, "model.pt")
        """))
    assert run.error is None, run.traceback
    again = kernel.run("import torch\nprint(torch.load('model.pt')['w'].tolist())")
    assert again.stdout.strip() == "[0, 1, 2]", again.stdout + again.traceback


def test_a_killed_kernel_leaves_nothing_on_any_node(ray_cluster, tmp_path):
    others = set(agents(ray_cluster))  # another kernel's agents (the module's) stay
    k = connected_kernel(ray_cluster, tmp_path)
    try:
        kernel_pid, ranks, mine = sleeping_job(ray_cluster, k, others)
        import os
        import signal

        os.kill(kernel_pid, signal.SIGKILL)
        # The job's processes end within 10 s (each agent learns from the GCS that the
        # kernel's driver ended); the agents are actors of the kernel's Ray connection, which
        # Ray ends.
        assert wait_until_gone(ranks, timeout=10) == [], [cmdline(p) for p in job_processes(ray_cluster)]
        assert wait_until_gone(mine, timeout=120) == []
        assert placement_groups_left(ray_cluster) == "0"
    finally:
        k.shutdown()


def test_a_registered_loader_feeds_ranks_on_both_gpu_nodes_from_the_cpu_node(kernel, ray_cluster):
    """Units travel over TCP: loader workers on the CPU node, a relay on each GPU node."""
    import json

    setup = kernel.run(cell(LOADER_SETUP))
    assert setup.error is None, setup.traceback
    cpu_nodes = re.search(r"CPU (\S+)", setup.stdout).group(1).split(",")
    assert len(cpu_nodes) == len(ray_cluster.cpu_node_ips) == 1, setup.stdout
    shm = "import os\nprint(sorted(n for n in os.listdir('/dev/shm') if n.startswith('taas-')))"
    before = kernel.run(shm).stdout.strip()

    run = kernel.run(cell(LOADER_CELL))
    assert run.error is None, run.traceback + run.stderr
    rows = {int(r): json.loads(row) for r, row in re.findall(r"\[rank(\d)\] FED (.*)", run.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], run.stdout + run.stderr
    units = sorted(i for _, _, got, _ in rows.values() for i in got)
    assert units == list(range(400))  # every unit exactly once across the ranks
    assert all(nodes == cpu_nodes for _, nodes, _, _ in rows.values()), rows  # loaded on the CPU node
    seen = sorted({ip for r in range(4) for ip in rows[r][3]})
    assert seen == sorted(ray_cluster.gpu_node_ips), rows  # a relay on each GPU node
    rank_nodes = [rows[r][0] for r in range(4)]
    assert rank_nodes[0] == rank_nodes[1] != rank_nodes[2] == rank_nodes[3], rank_nodes
    assert cpu_nodes[0] not in rank_nodes
    assert "400/400 units delivered to 4 ranks" in run.stderr + run.stdout, run.stderr

    assert wait_until_gone([p.pid for p in job_processes(ray_cluster)] + [p.pid for p in relays(ray_cluster)],
                           timeout=30) == []
    assert kernel.run(shm).stdout.strip() == before  # no segment of the job left


def test_percent_taas_cluster_local_ends_the_connection(kernel, ray_cluster):
    """Back to this machine: this kernel's agents go (with the GPUs they kept reserved for a
    warm next cell), no placement group is left, and connecting again works."""
    run = kernel.run(cell("""
        %%taas --gpus 4
        print("warm", flush=True)
        """))
    assert run.error is None, run.traceback
    ours = agents_of(kernel, ray_cluster)
    assert len(ours) >= 2, ours  # one per GPU node at least
    local = kernel.run("%taas cluster local")
    assert local.error is None, local.traceback
    assert wait_until_gone(ours, timeout=120) == []
    assert placement_groups_left(ray_cluster) == "0"
    again = kernel.run(f"%taas cluster {ray_cluster.address}")  # as the module's fixture left it
    assert again.error is None, again.traceback
