"""DataSphere's largest shape on the simulated cluster, through a real kernel, as a user writes
the notebook: a registered loader in one cell, then ``#pragma taas --gpus 32 --cpus 2 --units K``
over four "GPU" nodes of 8 GPUs each, the loader workers on two CPU nodes.

The cluster is the module's own (tests/support/cluster.py with this shape), not the session's
small one.  No node has CUDA: the 32 ranks run gloo on CPU, placed as they would be on GPUs.
What must hold: every unit delivered exactly once across the ranks; GROUP_RANK 0-3 and
LOCAL_RANK 0-7 with each node's ranks on one node; the rank panel grouped per node (over 16
ranks, taas.io.panel); the line every rank prints shown once as ``[rank0-31] ...``
(taas.io.collapse); nothing left behind afterwards (processes, shared memory, ports,
placement groups).  A second cell right after the first runs on the warm agents.

Figures (printed, never asserted as times; ``pytest -s`` shows them): the cells' times, the
namespace's memory while all 32 ranks are up, by kind of process (RSS, and PSS: shared pages
counted once).  Memory is asserted only per rank: a rank forked from its node's start process
shares torch's pages with it (RSS ~400 MB each, PSS ~50 MB measured), so it stays far below
PER_RANK_PSS.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from tests.support.cluster import SimulatedCluster, missing_requirements
from tests.support.cluster_helpers import agents, connected_kernel, job_processes, named, placement_groups_left, relays
from tests.support.ranks import per_rank
from tests.support.kernel_driver import (cell, cmdline, process_name, shm_entries, wait_for,
                                         wait_until_gone)

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

GPU_NODES, GPUS_PER_NODE, CPU_NODES = 4, 8, 2
WORLD = GPU_NODES * GPUS_PER_NODE
UNITS = 10 * WORLD

# Bounds for "until it happens" on a 2-core machine with other programs burning CPU beside the
# suite: only a real failure reaches them.
SEEN_TIMEOUT = 600.0
PER_RANK_PSS = 300 << 20  # a rank shares torch's pages with its node's start process

SETUP = f"""
import os, torch, taas
from torch.utils.data import Dataset, DataLoader

class Where(Dataset):
    \"\"\"Unit i, and the node (TAAS_NODE_ID of the loader worker) that loaded it.\"\"\"
    def __len__(self):
        return {UNITS}
    def __getitem__(self, i):
        return {{"i": torch.tensor(i), "node": os.environ.get("TAAS_NODE_ID", "kernel")}}

fed = DataLoader(Where(), batch_size=1)
taas.register(fed)
"""

# One all_reduce, a line every rank prints identically, a loop over the loader, one JSON line
# per rank; then, given a hold file, rank 0 waits for the test to have seen the panel grouped per node,
# while the other ranks wait in the barrier.
JOB = """
#pragma taas --gpus {world} --cpus 2 --units {units}
import os, json, time, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
print(f"all {{int(t.item())}} ranks reduced", flush=True)
got, loaded_on = [], set()
for b in fed:
    got.append(int(b["i"]))
    loaded_on.update(b["node"])
env = [int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")]
print("FED", json.dumps([env, os.environ["TAAS_NODE_ID"], sorted(loaded_on), got]), flush=True)
if {hold!r} and dist.get_rank() == 0:
    deadline = time.monotonic() + {bound}
    while not os.path.exists({hold!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
dist.barrier()
"""


def job(hold: str = "") -> str:
    return cell(JOB.format(world=WORLD, units=UNITS, hold=hold, bound=SEEN_TIMEOUT))


@pytest.fixture(scope="module")
def cluster():
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    c = SimulatedCluster(gpu_nodes=GPU_NODES, cpu_nodes=CPU_NODES, gpus_per_node=GPUS_PER_NODE).start()
    yield c
    c.stop()


def pss(pid: int) -> int:
    """Proportional set size in bytes (shared pages divided among their processes); 0 if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def kind(p) -> str:
    """What a process in the namespace is, for the memory figures."""
    name, argv = process_name(p), " ".join(cmdline(p))
    if name.startswith("taas-"):
        return re.sub(r"[\d:]+.*$", "", name)  # taas-rank, taas-loader, taas-start, ... (no numbers)
    if "NodeAgent" in argv:
        return "agent"
    if "ipykernel" in argv:
        return "kernel"
    if argv.startswith("ray::"):
        return "ray worker"
    return "ray daemon"


def memory(cluster) -> dict:
    """The namespace's memory now: RSS and PSS summed over every process, and PSS by kind."""
    figures = {"rss": 0, "pss": 0, "processes": 0, "kinds": {}}
    for p in cluster.processes():
        try:
            rss = p.memory_info().rss
        except Exception:  # broad: psutil.Error, it ended while we looked
            continue
        share = pss(p.pid)
        figures["rss"] += rss
        figures["pss"] += share
        figures["processes"] += 1
        count, total_rss, total_pss = figures["kinds"].get(kind(p), (0, 0, 0))
        figures["kinds"][kind(p)] = (count + 1, total_rss + rss, total_pss + share)
    return figures


def described(figures: dict) -> str:
    mb = 1 << 20
    kinds = ", ".join(f"{name} x{n}: RSS {r // n // mb} / PSS {s // n // mb} MB each"
                      for name, (n, r, s) in sorted(figures["kinds"].items(), key=lambda kv: -kv[1][2]))
    return (f"{figures['processes']} processes, RSS {figures['rss'] // mb} MB summed, "
            f"PSS {figures['pss'] // mb} MB ({kinds})")


def listening(cluster) -> set[tuple[int, int, str]]:
    """(pid, port, process name and command line) of every listening TCP socket inside the
    namespace (its own network: only a process inside sees them; pids as seen inside)."""
    script = ("import json, psutil\n"
              "out = []\n"
              "for c in psutil.net_connections('tcp'):\n"
              "    if c.status == psutil.CONN_LISTEN and c.pid:\n"
              "        try:\n"
              "            p = psutil.Process(c.pid)\n"
              "            title = p.name() + ' ' + ' '.join(p.cmdline())[:80]\n"
              "        except psutil.Error:\n"
              "            continue\n"
              "        out.append([c.pid, c.laddr.port, title])\n"
              "print(json.dumps(out))")
    done = cluster.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {tuple(row) for row in json.loads(done.stdout)}


def is_taas(title: str) -> bool:
    """Whether a process (by its name and command line) is one of taas's: a rank, loader worker,
    relay, start process, or a node agent."""
    return title.startswith("taas-") or "NodeAgent" in title


def check_ranks(run, cpu_nodes: int) -> None:
    """Every unit once, node and local ranks right, loaded on the CPU nodes, the line every
    rank printed collapsed into one."""
    rows = {}
    for tag, row in re.findall(r"^\[rank(\d+)\] FED (.*)$", run.stdout, re.MULTILINE):
        (rank, local, group, local_world, world), node, loaded_on, got = json.loads(row)
        assert int(tag) == rank and world == WORLD and local_world == GPUS_PER_NODE, row
        rows[rank] = (local, group, node, loaded_on, got)
    assert sorted(rows) == list(range(WORLD)), run.stdout[-3000:] + run.stderr[-3000:]
    units = sorted(i for *_, got in rows.values() for i in got)
    assert units == list(range(UNITS))  # every unit exactly once across the ranks
    assert all(len(got) == UNITS // WORLD for *_, got in rows.values())
    for rank, (local, group, *_) in rows.items():
        assert (group, local) == divmod(rank, GPUS_PER_NODE), (rank, rows[rank][:3])
    nodes = [rows[r][2] for r in range(WORLD)]
    for g in range(GPU_NODES):  # each node's ranks on one node, a different one per group rank
        assert len(set(nodes[g * GPUS_PER_NODE:(g + 1) * GPUS_PER_NODE])) == 1, nodes
    assert len(set(nodes)) == GPU_NODES, nodes
    loaders = {n for *_, loaded_on, _ in rows.values() for n in loaded_on}
    assert len(loaders) == cpu_nodes and not loaders & set(nodes), (loaders, nodes)
    # The line every rank printed: collapsed, each rank's copy shown exactly once.  Usually one
    # line `[rank0-31] ...`; the collapse waits 0.3 s for silent ranks (a time, so on a machine
    # loaded enough to spread 32 ranks' prints wider than that it may show as a few groups:
    # tests/unit/io/test_collapse.py pins the exact rule with an injected clock).
    reduced = [line for line in run.stdout.splitlines() if line.endswith(f"all {WORLD} ranks reduced")]
    each = sorted(per_rank("\n".join(reduced)).splitlines())
    assert each == sorted(f"[rank{r}] all {WORLD} ranks reduced" for r in range(WORLD)), reduced
    assert len(reduced) <= WORLD // 4, reduced  # collapsed, not 32 lines
    assert f"{UNITS}/{UNITS} units delivered to {WORLD} ranks" in run.stdout + run.stderr


def grouped_per_node(texts: list[str]) -> list[str] | None:
    """The first panel (text form) with a row per node, each node's 8 ranks known: its lines."""
    for text in texts:
        lines = text.splitlines()
        heads = [line.split()[0] for line in lines[1:] if line.strip()]
        if heads[:1] == ["node"] and all(
                any(line.startswith(f"node{g} ({GPUS_PER_NODE} ranks)") for line in lines)
                for g in range(GPU_NODES)):
            return lines
    return None


@pytest.mark.timeout(1800)  # the cluster's start and a cold 32-rank job on 2 busy cores
def test_32_ranks_over_four_nodes_fed_from_two_cpu_nodes(cluster, tmp_path):
    started = time.monotonic()
    workdir = tmp_path / "notebook"
    workdir.mkdir()
    ports_before = listening(cluster)
    shm_before = shm_entries()
    k = connected_kernel(cluster, workdir)
    try:
        setup = k.run(cell(SETUP))
        assert setup.error is None, setup.traceback
        idle = memory(cluster)

        # The cold cell: held open until the panel shows the four nodes (figures read then).
        seen: dict = {}
        go = str(tmp_path / "panel-seen")

        def on_panel(out):
            if "lines" in seen:
                return
            lines = grouped_per_node([data["text/plain"] for _, data in out.panels])
            if lines:
                seen["lines"] = lines
                seen["memory"] = memory(cluster)
                seen["ports"] = {port for _, port, title in listening(cluster) if is_taas(title)}
                open(go, "w").close()

        cold_at = time.monotonic()
        cold = k.run(job(hold=go), on_panel=on_panel)
        cold_s = time.monotonic() - cold_at
        assert cold.error is None, cold.traceback + cold.stderr[-3000:]
        check_ranks(cold, CPU_NODES)
        assert "lines" in seen, [data["text/plain"] for _, data in cold.panels]
        rows = [line for line in seen["lines"] if line.startswith("node")]
        assert rows[0].split()[:2] == ["node", "state"] and len(rows) == 1 + GPU_NODES, seen["lines"]
        assert not any(re.match(r"rank\d+ ", line) for line in seen["lines"]), seen["lines"]
        assert sum(1 for line in seen["lines"] if line.startswith("loader:fed:")) == 2, seen["lines"]
        assert all("<table" in data["text/html"] for _, data in cold.panels[:-1])
        last = cold.panels[-1][1]["text/plain"]
        assert last.startswith(f"taas: {WORLD} ranks, ") and last.endswith(f": done {WORLD}"), last
        figures = seen["memory"]
        ranks, _, ranks_pss = figures["kinds"]["taas-rank"]
        assert ranks == WORLD, figures
        assert ranks_pss / WORLD < PER_RANK_PSS, described(figures)

        # The warm cell, right after: the agents and their start processes are up.
        warm_at = time.monotonic()
        warm = k.run(job())
        warm_s = time.monotonic() - warm_at
        assert warm.error is None, warm.traceback + warm.stderr[-3000:]
        check_ranks(warm, CPU_NODES)

        job_ids = k.run("import taas\nprint(','.join(taas._loaded['session'].job_ids))").stdout.strip().split(",")
        assert len(job_ids) == 2, job_ids
        left = k.run("%taas cluster local")
        assert left.error is None, left.traceback
    finally:
        k.shutdown()

    # Nothing left behind: no taas process, agent, placement group, segment or port.
    gone = job_processes(cluster) + relays(cluster) + named(cluster, "taas-")
    assert wait_until_gone([p.pid for p in gone], timeout=30) == [], [cmdline(p) for p in gone]
    assert wait_until_gone(agents(cluster), timeout=120) == []
    assert placement_groups_left(cluster) == "0"
    ours = {n for n in shm_entries() - shm_before if any(n.startswith(f"taas-{j}") for j in job_ids)}
    assert wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in ours), timeout=30,
                    what="the jobs' shared memory going"), ours
    # Ports: those taas's processes listened on during the job (the relays', the rendezvous
    # store's) are closed, and no process but Ray's own (its idle worker pool; a raylet that
    # restarted, as one did once on a loaded CI machine) listens anew.
    assert seen["ports"], "no taas process was seen listening during the job"
    before = {pid for pid, _, _ in ports_before}

    def ports_left():
        return {row for row in listening(cluster)
                if row[1] in seen["ports"] or is_taas(row[2])
                or row[0] not in before and not any(ray in row[2] for ray in ("ray::IDLE", "/raylet/raylet "))}
    try:
        wait_for(lambda: not ports_left(), timeout=60, what="the ports closing")
    except TimeoutError:
        pytest.fail(f"ports left listening: {sorted(ports_left())}")

    print(f"\nlargest shape: cold cell {cold_s:.1f} s (held until the panel was seen), warm cell "
          f"{warm_s:.1f} s, test {time.monotonic() - started:.0f} s (cluster start not counted); "
          f"{len(seen['ports'])} ports of taas's processes listening during the job, none after\n"
          f"namespace before the job: {described(idle)}\n"
          f"namespace with the {WORLD} ranks up: {described(figures)}")
