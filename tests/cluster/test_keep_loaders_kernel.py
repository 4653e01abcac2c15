"""Registered loaders on kept ranks (--keep) on the simulated cluster, through a real kernel
(issue 16): each kept cell that reads a loader starts its loader workers on the CPU node and a
relay on each GPU node, every unit once per cell, on the same rank processes; the workers and
relays end with the cell; a loader failing in a kept cell raises in the ranks' cell code and the
kept state survives; nothing is left after %taas release or a killed kernel.

One kernel for the module (connected_module_kernel); every test releases its kept ranks."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.cluster_helpers import (agents, connected_kernel, job_processes, named,
                                          placement_groups_left, relays)
from tests.support.kernel_driver import (cell, cmdline, plain, shm_entries, unmapped_shm, wait_for,
                                         wait_until_gone)
from tests.support.kept import loader_failure_cell, ok
from tests.support.ranks import per_rank

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

SETUP = """
import os, time, torch, taas, ray
from torch.utils.data import DataLoader, Dataset

class Own(Dataset):
    '''Sample i is (i, the node that loaded it); sample `fail` raises once a file per rank is in
    `after` (the ranks are in the cell's code).'''
    def __init__(self, n, fail=None, after=None, ranks=4):
        self.n, self.fail, self.after, self.ranks = n, fail, after, ranks
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == self.fail:
            for _ in range(3000):
                if self.after is None or len(os.listdir(self.after)) >= self.ranks:
                    break
                time.sleep(0.01)
            raise ValueError(f"sample {i} is corrupt")
        return {"i": torch.tensor(i), "node": os.environ.get("TAAS_NODE_ID", "kernel")}

loader = DataLoader(Own(40), batch_size=2, shuffle=True)   # 20 units a pass
taas.register(loader)
cpu_nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("cpu_node"))
print("CPU", ",".join(cpu_nodes))
"""

# Every rank prints its pid, its node, the samples it got and the nodes that loaded them.
READ = """
import os, json
got, loaded = [], set()
for b in loader:
    got += b["i"].tolist()
    loaded.update(b["node"])
print("LOG", json.dumps([os.getpid(), os.environ["TAAS_NODE_ID"], got, sorted(loaded)]), flush=True)
"""


def _logs(run) -> dict[int, list]:
    out = {}
    for line in per_rank(run.stdout).splitlines():
        match = re.match(r"\[rank(\d+)\] LOG (.*)", line)
        if match:
            out[int(match.group(1))] = json.loads(match.group(2))
    return out


def _ranks(ray_cluster) -> list[int]:
    return sorted(p.pid for p in named(ray_cluster, "taas-rank"))


def _loader_job(ray_cluster) -> list[int]:
    """The pids of the loader workers and data relays running anywhere in the cluster."""
    return [p.pid for p in named(ray_cluster, "taas-loader")] + [p.pid for p in relays(ray_cluster)]


def _released(kernel, ray_cluster, pids, shm: set) -> None:
    """``%taas release``: the kept ranks, any loader worker or relay, their placement group and
    their shared memory go (other kernels' segments may be mapped: only unmapped ones leak)."""
    ok(kernel.run("%taas release"))
    assert wait_until_gone(pids, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert wait_until_gone(_loader_job(ray_cluster), timeout=5) == []
    assert placement_groups_left(ray_cluster) == "0"
    assert unmapped_shm({n for n in shm_entries() - shm if n.startswith("taas-")}, wait=5) == set()


@pytest.fixture(scope="module")
def cpu_nodes(kernel):
    run = ok(kernel.run(cell(SETUP)))
    return re.search(r"CPU (\S+)", run.stdout).group(1).split(",")


def test_kept_cells_each_get_every_unit_once_from_loader_workers_on_the_cpu_node(kernel, ray_cluster, cpu_nodes):
    shm = shm_entries()
    pids: list[int] = []
    inner: dict[int, int] = {}  # rank -> its pid as it sees it (inside the cluster's namespace)
    try:
        for i in range(2):  # the same loader in two kept cells, on the same ranks
            run = ok(kernel.run(("%%taas --gpus 4 --cpus 2 --keep\n" if i == 0 else "%%taas --cpus 2\n")
                                 + cell(READ)))
            logs = _logs(run)
            assert sorted(logs) == [0, 1, 2, 3], run.stdout + run.stderr
            if i == 0:
                pids, inner = _ranks(ray_cluster), {r: log[0] for r, log in logs.items()}
            assert {r: log[0] for r, log in logs.items()} == inner  # the kept rank processes
            assert sorted(i for _, _, got, _ in logs.values() for i in got) == list(range(40))  # once each
            assert all(loaded == cpu_nodes for *_, loaded in logs.values()), logs  # loaded on the CPU node
            assert len({node for _, node, _, _ in logs.values()}) == 2, logs  # ranks on both GPU nodes
            summary = [line for line in run.stdout.splitlines() if "units delivered" in line]
            assert len(summary) == 1 and "20/20 units delivered to 4 ranks by 2 workers" in summary[0], run.stdout
            # The cell's loader workers and relays end with it; the ranks stay.
            assert wait_until_gone(_loader_job(ray_cluster), timeout=10) == []
            assert _ranks(ray_cluster) == pids
        assert ok(kernel.run("%%taas\nlen(got)")).result == "10"  # the state is rank 0's
    finally:
        _released(kernel, ray_cluster, pids, shm)


def test_a_loader_failing_in_a_kept_cell_raises_in_the_ranks_and_the_state_stays(kernel, ray_cluster, cpu_nodes,
                                                                                tmp_path):
    shm = shm_entries()
    ok(kernel.run(f"bad = DataLoader(Own(200, fail=150, after={str(tmp_path)!r}), batch_size=2)\n"
                   "taas.register(bad)"))
    pids: list[int] = []
    try:
        ok(kernel.run("%%taas --gpus 4 --keep\nimport os\npid = os.getpid()\nkept = 'yes'"))
        pids = _ranks(ray_cluster)
        # One worker: its first slice is ready before it fails, once every rank is in the cell.
        run = kernel.run(loader_failure_cell("bad", str(tmp_path)))
        assert run.error is not None and run.error["ename"] == "JobFailed", run.stdout + run.stderr
        tb = plain(run.traceback)
        expected = "loader:bad:0 failed: ValueError: sample 150 is corrupt"
        assert tb.splitlines()[0] == expected, tb
        assert "rank3: its cell raised the loader's failure" in tb and "they and their state stay" in tb, tb
        assert "state is lost" not in run.stderr
        got = sorted(line.split(" GOT ")[1] for line in per_rank(run.stdout).splitlines() if " GOT " in line)
        assert got == [f"LoaderFailed {expected}"] * 4, (run.stdout, run.stderr, tb)
        assert wait_until_gone(_loader_job(ray_cluster), timeout=10) == []
        assert _ranks(ray_cluster) == pids
        # The state is there, and the next cell runs on the same ranks, with a healthy loader.
        assert ok(kernel.run("%%taas\nkept + str(os.getpid() == pid)")).result == "'yesTrue'"
        after = ok(kernel.run("%%taas\nprint('next', sum(len(b['i']) for b in loader))"))
        assert sum(int(n) for n in re.findall(r"next (\d+)", per_rank(after.stdout))) == 40, after.stdout
        assert _ranks(ray_cluster) == pids
    finally:
        kernel.run("taas.unregister(bad)")
        _released(kernel, ray_cluster, pids, shm)


def test_a_killed_kernel_leaves_no_kept_rank_loader_worker_relay_or_shared_memory(ray_cluster, tmp_path):
    others = set(agents(ray_cluster))  # the module kernel's agents stay
    shm = shm_entries()
    k = connected_kernel(ray_cluster, tmp_path)
    try:
        ok(k.run(cell(SETUP)))
        ok(k.run("%%taas --gpus 4 --keep\nx = 1"))
        ranks = _ranks(ray_cluster)
        k.run("slow = DataLoader(Own(2000), batch_size=1)\ntaas.register(slow)")
        k.execute("%%taas --cpus 2 --units 1000\nimport time\nfor b in slow:\n    time.sleep(1)")
        wait_for(lambda: len(named(ray_cluster, "taas-loader")) == 2 and len(relays(ray_cluster)) == 2,
                 timeout=300, what="the kept cell's loader workers and relays")
        loader_job = _loader_job(ray_cluster)
        mine = [pid for pid in agents(ray_cluster) if pid not in others]
        assert len(ranks) == 4 and mine
        os.kill(k.descendants()[0].pid, signal.SIGKILL)  # nsenter's child: the kernel itself
        assert wait_until_gone(ranks + loader_job, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
        assert wait_until_gone(mine, timeout=120) == []
        assert placement_groups_left(ray_cluster) == "0"
        assert unmapped_shm({n for n in shm_entries() - shm if n.startswith("taas-")}, wait=5) == set()
    finally:
        k.shutdown()
