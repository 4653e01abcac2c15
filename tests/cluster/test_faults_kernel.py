"""Faults across machines, through a real kernel inside the simulated cluster (tests/support/cluster.py:
GPU-like nodes 127.0.1.1 and 127.0.1.2, a CPU node 127.0.2.1): a rank killed on the second
node, a node's agent killed, the kernel killed while a registered loader feeds the ranks, and
``--max-restarts`` across nodes.  Each ends the whole job, leaves nothing on any node, and
leaves the kernel able to run the next cell."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.support.cluster_helpers import (LOADER_SETUP, agent_of, agents, connected_kernel, job_processes,
                                          named, placement_groups_left, relays)
from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.kernel_driver import cell, cmdline, plain, process_name, wait_for, wait_until_gone
from tests.support.ranks import per_rank

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

# Ranks 0-2 wait in a barrier for rank 3, which never comes: only a stop ends them.
WAITING = cell("""
    %%taas --gpus 4
    import os, time, torch.distributed as dist
    print("up on node", os.environ["GROUP_RANK"], flush=True)
    if os.environ["RANK"] == "3":
        time.sleep(600)
    dist.barrier()
    """)

# Four ranks over both nodes, one all_reduce: the cell that must work after each fault.
ALL_REDUCE = cell("""
    %%taas --gpus 4
    import os, torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print("node", os.environ["GROUP_RANK"], flush=True)
    total = t.item()
    """)


def run_killing(kernel, ray_cluster, code: str, victim, timeout: float = 600.0):
    """Run ``code``; once every rank printed "up", SIGKILL the pid ``victim(ranks)`` picks from
    the job's rank processes (psutil, outer pids).  Returns (the cell's run, the job's
    processes when the victim was killed, the victim's pid)."""
    seen: dict = {}

    def on_output(out):
        if "victim" not in seen and all(f"[rank{r}] up" in per_rank(out.stdout) for r in range(4)):
            ranks = wait_for(lambda: (lambda found: found if len(found) == 4 else None)(
                {process_name(p): p for p in named(ray_cluster, "taas-rank")}), timeout=60, what="4 ranks")
            seen["victim"] = victim(ranks)
            seen["job"] = [p.pid for p in job_processes(ray_cluster)] + [p.pid for p in relays(ray_cluster)]
            os.kill(seen["victim"], signal.SIGKILL)

    run = kernel.run(code, on_output=on_output, timeout=timeout)
    assert "victim" in seen, run.stdout + run.stderr + run.traceback
    return run, seen["job"], seen["victim"]


def assert_next_cell_works(kernel):
    run = kernel.run(ALL_REDUCE)
    assert run.error is None, run.traceback + run.stderr
    assert sorted(re.findall(r"\[rank(\d)\] node (\d)", per_rank(run.stdout))) == [
        ("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], run.stdout
    assert kernel.run("print(total)").stdout.strip() == "10.0"


def test_a_rank_killed_on_the_second_node_stops_the_whole_job(kernel, ray_cluster):
    run, job, _ = run_killing(kernel, ray_cluster, WAITING, lambda ranks: ranks["taas-rank3"].pid)
    assert "[rank3] up on node 1" in per_rank(run.stdout), per_rank(run.stdout)  # on the second GPU node
    assert run.status == "error"
    tb = plain(run.traceback)
    assert tb.splitlines()[0].startswith("rank3 was killed by SIGKILL"), tb
    assert "rank0: stopped after rank3 failed" in tb, tb
    assert wait_until_gone(job, timeout=10) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert_next_cell_works(kernel)


def test_a_killed_agent_ends_its_ranks_and_the_job_and_the_next_cell_gets_a_fresh_one(kernel, ray_cluster):
    killed = {}

    def second_nodes_agent(ranks):
        killed["agent"] = agent_of(ranks["taas-rank3"])
        assert killed["agent"] is not None, [cmdline(p) for p in ranks["taas-rank3"].parents()]
        assert agent_of(ranks["taas-rank0"]) != killed["agent"]
        killed["agents"] = len(agents(ray_cluster))
        return killed["agent"]

    # Not after gloo's timeout (30 min): the cell must end well before this bound.
    run, job, _ = run_killing(kernel, ray_cluster, WAITING, second_nodes_agent, timeout=120)
    assert run.status == "error"
    tb = plain(run.traceback)
    first = tb.splitlines()[0]
    second_node = ray_cluster.gpu_node_ips[1]
    assert re.match(r"rank[23] ", first) and second_node in first, tb
    assert wait_until_gone(job, timeout=10) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert placement_groups_left(ray_cluster) == "0"
    assert_next_cell_works(kernel)
    assert killed["agent"] not in agents(ray_cluster)
    assert len(agents(ray_cluster)) == killed["agents"]  # a fresh one on the second node


def test_max_restarts_across_nodes_gives_the_uninterrupted_result(kernel):
    code = cell("""
        %%taas --gpus 4 --max-restarts 1
        import os, torch, torch.distributed as dist
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if fail and attempt == 0 and os.environ["RANK"] == "3":
            raise RuntimeError("rank three fails on node " + os.environ["GROUP_RANK"])
        t = torch.arange(4.0) * (dist.get_rank() + 1) + float(os.environ["GROUP_RANK"])
        dist.all_reduce(t)
        result = t.tolist()
        """)
    assert kernel.run("fail = False").error is None
    plain_run = kernel.run(code)
    assert plain_run.error is None, plain_run.traceback
    assert "taas: restart" not in plain_run.stderr
    uninterrupted = kernel.run("print(attempt, result)").stdout.strip()

    assert kernel.run("fail = True").error is None
    run = kernel.run(code)
    assert run.error is None, run.traceback + run.stderr
    err = plain(run.stderr)
    assert err.count("taas: restart ") == 1, err
    assert "taas: restart 1/1: rank3 failed: RuntimeError: rank three fails on node 1" in err, err
    again = kernel.run("print(attempt, result)").stdout.strip()
    assert again.split(" ", 1) == ["1", uninterrupted.split(" ", 1)[1]], (again, uninterrupted)
    assert uninterrupted.startswith("0 ")


# Many more units than the rings hold: the loader worker is still at work (blocked by
# backpressure) when the kernel dies.
FEEDING = cell("""
    %%taas --gpus 4 --cpus 1 --units 1000000
    import time
    for b in fed:
        print("fed", flush=True)
        break
    time.sleep(600)
    """)


class _Killed(Exception):
    """Raised from a cell's output callback once the kernel is killed: its cell never ends."""


def test_a_killed_kernel_leaves_no_loader_relay_agent_group_or_segment(ray_cluster, tmp_path):
    others = set(agents(ray_cluster))  # the module kernel's agents stay
    k = connected_kernel(ray_cluster, tmp_path)
    seen: dict = {}

    def on_output(out):
        if "job" in seen or not all(f"[rank{r}] fed" in per_rank(out.stdout) for r in range(4)):
            return
        ranks = named(ray_cluster, "taas-rank")
        seen["job_id"] = wait_for(lambda: _mapped_job(ranks), what="the ranks mapping the job's segments")
        seen["job"] = [p.pid for p in ranks + named(ray_cluster, "taas-loader") + relays(ray_cluster)]
        seen["counts"] = (len(ranks), len(named(ray_cluster, "taas-loader")), len(relays(ray_cluster)))
        seen["agents"] = [pid for pid in agents(ray_cluster) if pid not in others]
        os.kill(k.descendants()[0].pid, signal.SIGKILL)  # nsenter's child: the kernel itself
        raise _Killed

    try:
        setup = k.run(cell(LOADER_SETUP))
        assert setup.error is None, setup.traceback
        try:
            run = k.run(FEEDING, on_output=on_output)
        except _Killed:
            pass
        else:
            pytest.fail(f"the job ended before the kernel was killed: {run.stdout}{run.stderr}{run.traceback}")
        assert seen["counts"] == (4, 1, 2), seen  # 4 ranks, a loader worker, a relay per GPU node
        assert seen["agents"], "this kernel's agents were not found"
        segments = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"taas-{seen['job_id']}-"))  # noqa: E731

        assert wait_until_gone(seen["job"], timeout=10) == [], [cmdline(p) for p in job_processes(ray_cluster)]
        assert wait_until_gone(seen["agents"], timeout=120) == []
        assert placement_groups_left(ray_cluster) == "0"
        wait_for(lambda: not segments(), timeout=10, what="the job's segments going")
    finally:
        k.shutdown()


def _mapped_job(processes) -> str | None:
    """The id of the job whose /dev/shm segments one of ``processes`` maps (taas-<job>-...)."""
    for p in processes:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                found = re.search(r"/dev/shm/taas-([0-9a-f]{12})-", f.read())
        except OSError:
            continue
        if found:
            return found.group(1)
    return None
