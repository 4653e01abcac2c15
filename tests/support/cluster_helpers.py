"""What the simulated-cluster kernel tests share: finding taas's processes inside the cluster
(by the names the start process gives them), its agents, and what a job left in the cluster
(placement groups)."""

from __future__ import annotations

import sys

from tests.support.kernel_driver import cmdline, process_name, wait_for


def connected_kernel(ray_cluster, workdir):
    """A kernel inside the cluster's namespace, in ``workdir``, connected with ``%taas cluster``."""
    k = ray_cluster.kernel(str(workdir))
    run = k.run(f"%taas cluster {ray_cluster.address}")
    assert run.error is None, run.traceback
    k.workdir = workdir
    return k


def named(ray_cluster, *prefixes: str) -> list:
    """Processes inside the cluster whose name (comm) starts with one of ``prefixes``."""
    return [p for p in ray_cluster.processes() if process_name(p).startswith(prefixes)]


def job_processes(ray_cluster) -> list:
    """taas's rank and loader processes anywhere in the cluster."""
    return named(ray_cluster, "taas-rank", "taas-loader")


def relays(ray_cluster) -> list:
    """The data transport's relays (comm is cut at 15 characters)."""
    return named(ray_cluster, "taas-data-rela")


def agents(ray_cluster) -> list[int]:
    """The pids of every NodeAgent actor's worker process in the cluster."""
    return [p.pid for p in ray_cluster.processes() if "NodeAgent" in " ".join(cmdline(p))]


def agent_of(process) -> int | None:
    """The pid of the agent whose start process forked ``process`` (its nearest NodeAgent
    ancestor: agent -> guard -> start process -> rank)."""
    try:
        for parent in process.parents():
            if "NodeAgent" in " ".join(cmdline(parent)):
                return parent.pid
    except Exception:  # broad: psutil.Error, the process ended meanwhile
        pass
    return None


def placement_groups_left(ray_cluster, wait: float = 30.0) -> str:
    """How many placement groups the cluster still holds (not REMOVED), waiting up to ``wait``
    s for it to reach 0; the checking script's whole output on a failure."""
    check = ray_cluster.run([sys.executable, "-c", (
        "import ray, time; ray.init(address='%s', log_to_driver=False)\n"
        "from ray.util import placement_group_table as t\n"
        "left = lambda: sum(1 for g in t().values() if g['state'] != 'REMOVED')\n"
        "deadline = time.monotonic() + %r\n"
        "while left() and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "print(left())") % (ray_cluster.address, wait)],
        capture_output=True, text=True, timeout=300)
    lines = check.stdout.strip().splitlines()
    return lines[-1] if lines and lines[-1] == "0" else check.stdout + check.stderr


LOADER_SETUP = """
import os, torch, taas, ray
from torch.utils.data import Dataset, DataLoader

class Where(Dataset):
    \"\"\"Each sample says which node loaded it (TAAS_NODE_ID of the loader worker).\"\"\"
    def __len__(self):
        return 400
    def __getitem__(self, i):
        return {"i": torch.tensor(i), "x": torch.full((8,), float(i)), "node": os.environ.get("TAAS_NODE_ID", "kernel")}

fed = DataLoader(Where(), batch_size=1)
taas.register(fed)
cpu_nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("cpu_node"))
print("CPU", ",".join(cpu_nodes))
"""


def sleeping_job(ray_cluster, k, others: set) -> tuple[int, list[int], list[int]]:
    """Start a 4-rank job that sleeps in kernel ``k`` (connected); once its ranks run:
    (the kernel's pid, the ranks' pids, the pids of the agents ``k`` started: not in ``others``)."""
    k.execute("%%taas --gpus 4\nimport time\nprint('up', flush=True)\ntime.sleep(600)")
    wait_for(lambda: len(job_processes(ray_cluster)) >= 4, timeout=300, what="the ranks starting")
    kernel_pid = k.descendants()[0].pid  # nsenter's child: the kernel itself
    ranks = [p.pid for p in job_processes(ray_cluster)]
    mine = [pid for pid in agents(ray_cluster) if pid not in others]
    assert mine, "this kernel's agents were not found"
    return kernel_pid, ranks, mine

