"""What the simulated-cluster kernel tests share: a kernel connected to the cluster, finding
taas's processes inside it (by the names the start process gives them), its agents, what a job
left in the cluster (placement groups), and the cells several test modules run.

The harness itself (namespace, nodes, running a command inside) is tests/support/cluster.py;
this module knows taas (its process names, its session's agents), that one does not."""

from __future__ import annotations

import queue
import sys

import pytest

from tests.support.kernel_driver import cmdline, process_name, wait_for


def connected_kernel(ray_cluster, workdir, address: str | None = None, options: str = "",
                     env: dict | None = None):
    """A kernel inside the cluster's namespace, in ``workdir``, connected with ``%taas cluster
    ADDRESS OPTIONS`` (default: the cluster's GCS address); that cell's run is ``k.connected``.
    A kernel that cannot connect is shut down before the assertion fails."""
    k = ray_cluster.kernel(str(workdir), env=env)
    run = k.run(f"%taas cluster {address or ray_cluster.address} {options}".rstrip())
    if run.error is not None:
        k.shutdown()
    assert run.error is None, run.traceback
    k.workdir = workdir
    k.connected = run
    return k


@pytest.fixture(scope="module", name="kernel")
def connected_module_kernel(ray_cluster, tmp_path_factory):
    """The ``kernel`` fixture of a module that imports this one: connected to the cluster's GCS
    address, in a fresh notebook directory.  ``%taas cluster local`` at the end ends the
    connection: its agents and placement groups go."""
    k = connected_kernel(ray_cluster, tmp_path_factory.mktemp("notebook"))
    yield k
    k.run("%taas cluster local")
    k.shutdown()


def named(ray_cluster, *prefixes: str) -> list:
    """Processes inside the cluster whose name (comm) starts with one of ``prefixes``."""
    return [p for p in ray_cluster.processes() if process_name(p).startswith(prefixes)]


def job_processes(ray_cluster) -> list:
    """taas's rank and loader processes anywhere in the cluster."""
    return named(ray_cluster, "taas-rank", "taas-loader")


def relays(ray_cluster) -> list:
    """The data transport's relays (comm is cut at 15 characters)."""
    return named(ray_cluster, "taas-data-rela")


def _is_agent(process) -> bool:
    """Whether ``process`` is a NodeAgent actor's worker (Ray names the actor class in its argv)."""
    return "NodeAgent" in " ".join(cmdline(process))


def agents(ray_cluster) -> list[int]:
    """The pids of every NodeAgent actor's worker process in the cluster."""
    return [p.pid for p in ray_cluster.processes() if _is_agent(p)]


def agent_of(process) -> int | None:
    """The pid of the agent whose start process forked ``process`` (its nearest NodeAgent
    ancestor: agent -> guard -> start process -> rank)."""
    try:
        for parent in process.parents():
            if _is_agent(parent):
                return parent.pid
    except Exception:  # broad: psutil.Error, the process ended meanwhile
        pass
    return None


def agents_of(kernel, ray_cluster) -> list[int]:
    """The (outer) pids of this kernel's agents: they report their pids inside the namespace
    (``describe()``), which /proc/PID/status's NSpid line maps."""
    run = kernel.run("import taas\n"
                     "print(sorted(i['pid'] for i in taas._loaded['session']._cluster_launcher._info.values()))")
    inner = set(eval(run.stdout.strip()))
    return [pid for pid in agents(ray_cluster) if inner_pid(pid) in inner]


def inner_pid(pid: int) -> int | None:
    """The pid that process ``pid`` (as seen here) has inside the cluster's PID namespace, as
    processes there report it (/proc/PID/status's NSpid line); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line.split()[-1] for line in f if line.startswith("NSpid:")))
    except (OSError, StopIteration, ValueError):  # gone meanwhile
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


# Ranks on both GPU nodes read the registered ``fed`` (LOADER_SETUP) and print, as one JSON line,
# their node, the nodes that loaded their units, the units, and where their node's relay listens.
LOADER_CELL = """
%%taas --gpus 4 --cpus 2 --units 400
import os, json, torch
import psutil

def relays_listening():  # where the job's relays listen (one lives while a rank of its node does)
    ips = []
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "taas-data-relay":
            conns = getattr(p, "net_connections", None) or p.connections
            ips += [c.laddr.ip for c in conns("tcp") if c.status == "LISTEN"]
    return ips

got, nodes, relay_ips = [], set(), None
for b in fed:
    if relay_ips is None:  # while this rank reads, its node's relay is there
        relay_ips = relays_listening()
    i = int(b["i"])
    assert torch.equal(b["x"], torch.full((1, 8), float(i))), (i, b["x"])
    got.append(i)
    nodes.update(b["node"])
print("FED", json.dumps([os.environ["TAAS_NODE_ID"], sorted(nodes), got, sorted(relay_ips or [])]), flush=True)
"""


def _iopub_of(k, msg_id: str) -> list[dict]:
    """What the cell ``msg_id`` published so far (streams, errors)."""
    out = []
    while True:
        try:
            msg = k.kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            return out
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] in ("stream", "error"):
            out.append(msg)


def sleeping_job(ray_cluster, k, others: set) -> tuple[int, list[int], list[int]]:
    """Start a 4-rank job that sleeps in kernel ``k`` (connected); once its ranks run:
    (the kernel's pid, the ranks' pids, the pids of the agents ``k`` started: not in ``others``)."""
    msg_id = k.execute("%%taas --gpus 4\nimport time\nprint('up', flush=True)\ntime.sleep(600)")

    def started() -> bool:
        if len(job_processes(ray_cluster)) >= 4:
            return True
        # A cell that already ended will never start its ranks: say what it showed, now.
        try:
            reply = k.kc.get_shell_msg(timeout=0)
        except queue.Empty:
            return False
        if reply["parent_header"].get("msg_id") == msg_id:
            shown = [m["content"] for m in _iopub_of(k, msg_id)]
            raise AssertionError(f"the cell ended before its ranks ran: {reply['content']} {shown}")
        return False

    wait_for(started, timeout=300, what="the ranks starting")
    kernel_pid = k.descendants()[0].pid  # nsenter's child: the kernel itself
    ranks = [p.pid for p in job_processes(ray_cluster)]
    mine = [pid for pid in agents(ray_cluster) if pid not in others]
    assert mine, "this kernel's agents were not found"
    return kernel_pid, ranks, mine

