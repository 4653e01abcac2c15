"""A taas cell across machines through Ray Client: the kernel connects with
``%taas cluster ray://HOST:10001`` (the head's client server, tests/support/cluster.py) instead of the
GCS address, and everything the GCS-address tests check in short works the same: the cluster
shown, ranks on both GPU nodes with torchrun's environment, a registered loader fed from the
CPU node, and ``%taas cluster local`` leaving nothing behind.

Under Ray Client the kernel is not a Ray driver: the client server on the head starts a proxy
driver for it, which owns the agents.  A killed kernel's agents therefore end its job only
when that proxy ends: after the client's reconnect grace period (the kernel's
``RAY_CLIENT_RECONNECT_GRACE_PERIOD``, 30 s by default), not at once."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.support.cluster_helpers import (LOADER_CELL, LOADER_SETUP, agents, agents_of, connected_kernel,
                                          job_processes, placement_groups_left, relays, sleeping_job)
from tests.support.kernel_driver import cell, cmdline, wait_until_gone

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

GRACE = 5  # the killed-kernel test's reconnect grace period (s): how long its proxy lingers


@pytest.fixture(scope="module")
def kernel(ray_cluster, tmp_path_factory):
    k = connected_kernel(ray_cluster, tmp_path_factory.mktemp("notebook"), address=ray_cluster.client_address)
    yield k
    k.run("%taas cluster local")
    k.shutdown()


def test_percent_taas_shows_the_cluster_through_ray_client(kernel, ray_cluster):
    run = kernel.run("%taas")
    assert run.error is None, run.traceback
    assert f"Ray cluster at {ray_cluster.client_address}" in run.stdout, run.stdout
    for ip in ray_cluster.gpu_node_ips + ray_cluster.cpu_node_ips:
        assert ip in run.stdout, run.stdout
    client = kernel.run("import ray\nprint(ray.util.client.ray.is_connected())")
    assert client.stdout.strip() == "True", client.stdout + client.traceback  # not a GCS driver


def test_ranks_spread_over_both_gpu_nodes_through_ray_client(kernel):
    run = kernel.run(cell("""
        %%taas --gpus 4
        import os, torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print("where", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"],
              os.environ["WORLD_SIZE"], os.environ["TAAS_NODE_ID"][:8], t.item(), flush=True)
        total = t.item()
        """))
    assert run.error is None, run.traceback
    rows = {int(r): (int(lr), int(g), int(w), node, float(s)) for r, lr, g, w, node, s
            in re.findall(r"where (\d) (\d) (\d) (\d) (\w+) ([\d.]+)", run.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], run.stdout
    assert [rows[r][:3] for r in range(4)] == [(0, 0, 4), (1, 0, 4), (0, 1, 4), (1, 1, 4)], rows
    assert rows[0][3] == rows[1][3] != rows[2][3] == rows[3][3], rows  # two nodes, two ranks each
    assert all(row[4] == 10.0 for row in rows.values()), rows
    assert kernel.run("print(total)").stdout.strip() == "10.0"


def test_a_registered_loader_feeds_ranks_through_ray_client(kernel, ray_cluster):
    """The data hub listens on the kernel's address as the head sees it: the nodes reach it."""
    setup = kernel.run(cell(LOADER_SETUP))
    assert setup.error is None, setup.traceback
    cpu_nodes = re.search(r"CPU (\S+)", setup.stdout).group(1).split(",")
    run = kernel.run(cell(LOADER_CELL))
    assert run.error is None, run.traceback + run.stderr
    rows = {int(r): json.loads(row) for r, row in re.findall(r"\[rank(\d)\] FED (.*)", run.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], run.stdout + run.stderr
    assert sorted(i for _, _, got, _ in rows.values() for i in got) == list(range(400))
    assert all(nodes == cpu_nodes for _, nodes, _, _ in rows.values()), rows
    seen = sorted({ip for r in range(4) for ip in rows[r][3]})
    assert seen == sorted(ray_cluster.gpu_node_ips), rows  # a relay on each GPU node
    assert wait_until_gone([p.pid for p in job_processes(ray_cluster)] + [p.pid for p in relays(ray_cluster)],
                           timeout=30) == []


def test_percent_taas_cluster_local_ends_the_ray_client_connection(kernel, ray_cluster):
    run = kernel.run("%%taas --gpus 4\nprint('warm', flush=True)")
    assert run.error is None, run.traceback
    ours = agents_of(kernel, ray_cluster)
    assert len(ours) >= 2, ours
    local = kernel.run("%taas cluster local")
    assert local.error is None, local.traceback
    assert wait_until_gone(ours, timeout=120) == []
    assert placement_groups_left(ray_cluster) == "0"
    again = kernel.run(f"%taas cluster {ray_cluster.client_address}")  # as the fixture left it
    assert again.error is None, again.traceback


def test_a_killed_ray_client_kernel_leaves_nothing_after_the_grace_period(ray_cluster, tmp_path):
    """The proxy driver lingers for the kernel's reconnect grace period, then ends; the agents
    see their owner's job end and stop the ranks; Ray ends the agents."""
    others = set(agents(ray_cluster))
    k = connected_kernel(ray_cluster, tmp_path, address=ray_cluster.client_address,
                         env={"RAY_CLIENT_RECONNECT_GRACE_PERIOD": str(GRACE)})
    try:
        kernel_pid, ranks, mine = sleeping_job(ray_cluster, k, others)
        os.kill(kernel_pid, signal.SIGKILL)
        assert wait_until_gone(ranks, timeout=GRACE + 60) == [], [cmdline(p) for p in job_processes(ray_cluster)]
        assert wait_until_gone(mine, timeout=120) == []
        assert placement_groups_left(ray_cluster) == "0"
    finally:
        k.shutdown()
