"""--detach on the simulated cluster (issue 21): the job's host is a detached Ray actor and its
record lives in the cluster's key-value store, so the job survives the notebook's driver.  A
kernel detaches a job and is SIGKILLed; a new kernel connected to the same cluster lists it,
attaches (the output so far, then live) and gets rank 0's names; a cancel leaves no rank; the
host actor killed takes its ranks with it and the record reads lost.

The module's kernel (connected_module_kernel) is the "new kernel"; the one killed is started
here.  Ranks wait for a file the test writes (an event), never for time."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.cluster_helpers import (LOADER_CELL, LOADER_SETUP, connected_kernel, inner_pid, job_processes, named,
                                           placement_groups_left)
from tests.support.kernel_driver import cell, cmdline, one_line_usage_error, plain, wait_for, wait_until_gone
from tests.support.kept import ok
from tests.support.ranks import per_rank

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

WAITING = """%%taas --gpus 2 --detach
import os, time, torch, torch.distributed as dist
print("before", dist.get_rank(), flush=True)
while not os.path.exists({go!r}):
    time.sleep(0.05)
total = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(total)
print("after", dist.get_rank(), flush=True)
answer = int(total.item()) * 10
"""


def _detached(run) -> str:
    assert run.error is None, run.traceback
    found = re.search(r"taas: job ([0-9a-f]{6}) detached: 2 ranks", run.stdout)
    assert found, run.stdout
    return found.group(1)


def _hosts(ray_cluster) -> list:
    """The JobHost actors' worker processes (Ray names the actor class in their argv)."""
    return [p for p in ray_cluster.processes() if "JobHost" in " ".join(cmdline(p))]


def _host_of(kernel, job: str) -> tuple[int, str]:
    """The pid and actor name of job ``job``'s host, as its record in the cluster's KV says."""
    run = kernel.run(
        "from taas.host.ray.client import host_name as _host_name\n"
        "_store, _ = get_ipython().magics_manager.registry['TaasMagics']._records()\n"
        f"print(_store.read({job!r}).host_pid, _host_name(_store, {job!r}))")
    assert run.error is None, run.traceback
    pid, name = run.stdout.split()
    return int(pid), name


def test_a_detached_job_outlives_its_kernel_and_a_new_kernel_lists_attaches_and_lands_it(
        kernel, ray_cluster, tmp_path):
    go = str(tmp_path / "go")
    (tmp_path / "first").mkdir()
    # Told of the cluster by $RAY_ADDRESS alone (no `%taas cluster`, which describes the nodes).
    first = ray_cluster.kernel(str(tmp_path / "first"), env={"RAY_ADDRESS": ray_cluster.address})
    try:
        job = _detached(first.run(WAITING.format(go=go)))
        # The job's host started the node agents; the kernel, which only detached, started none.
        agents = first.run("import taas\nprint(len(taas._loaded['session']._cluster_launcher._info))")
        assert agents.stdout.strip() == "0", (agents.stdout, agents.traceback)
        wait_for(lambda: len(job_processes(ray_cluster)) >= 2, timeout=120, what="the ranks running")
        ranks = [p.pid for p in job_processes(ray_cluster)]
        os.kill(first.descendants()[0].pid, signal.SIGKILL)  # the kernel (nsenter's child), its driver
        wait_for(lambda: not first.km.is_alive(), timeout=30, what="the first kernel gone")
        listed = kernel.run("%taas jobs")
        assert listed.error is None, listed.traceback
        assert re.search(rf"{job}\s+running\s+2\s+{re.escape(ray_cluster.address)}", listed.stdout), listed.stdout
        assert sorted(p.pid for p in job_processes(ray_cluster)) == sorted(ranks)  # it goes on
    finally:
        first.shutdown()

    def go_once_the_output_so_far_shows(out) -> None:  # then the ranks go on: the rest comes live
        if "before 1" in plain(out.stdout) and not os.path.exists(go):
            with open(go, "w"):
                pass

    attached = kernel.run(f"%taas attach {job}", on_output=go_once_the_output_so_far_shows)
    assert attached.error is None, attached.traceback
    text = plain(attached.stdout)
    assert text.index("before") < text.index("after"), text
    shown = kernel.run("print(answer)")
    assert shown.stdout.strip() == "30", (shown.stdout, shown.traceback)
    logs = plain(kernel.run(f"%taas logs {job}").stdout)
    assert "before 0" in logs and "before 1" in logs and "after 0" in logs, logs
    again = kernel.run(f"%taas attach {job}")
    # The output again, then one line: the results landed once.
    assert again.status == "error" and f"UsageError: taas: job {job}'s results were already taken" in again.stderr
    assert wait_until_gone(ranks, timeout=30) == []
    # Its host ended with its job, and the spare host the first kernel made after detaching
    # (for its next detached cell) ended by itself once that kernel was gone.
    wait_for(lambda: not _hosts(ray_cluster), timeout=120, what="the job host and the dead kernel's spare ending")
    forgot = kernel.run(f"%taas forget {job}")
    assert f"job {job} forgotten" in forgot.stdout, forgot.traceback


def test_a_detached_job_reads_a_registered_loader_from_the_cpu_node(kernel, ray_cluster):
    """The notebook makes the job (its registered loader, its data plane) as for an attached
    cluster cell; the host actor runs it with the plane's hub and relays where its own launcher
    plans them: every unit reaches the ranks on both GPU nodes once, loaded on the CPU node."""
    import json

    setup = kernel.run(cell(LOADER_SETUP))
    assert setup.error is None, setup.traceback
    cpu_nodes = re.search(r"CPU (\S+)", setup.stdout).group(1).split(",")
    run = kernel.run(cell(LOADER_CELL).replace("--units 400", "--units 400 --detach", 1))
    assert run.error is None, run.traceback + run.stderr
    job = re.search(r"taas: job ([0-9a-f]{6}) detached: 4 ranks", run.stdout)
    assert job, run.stdout
    done = kernel.run(f"%taas attach {job.group(1)}")
    assert done.error is None, done.traceback + done.stderr
    rows = {int(r): json.loads(row) for r, row in re.findall(r"\[rank(\d)\] FED (.*)", done.stdout)}
    assert sorted(rows) == [0, 1, 2, 3], done.stdout + done.stderr
    assert sorted(i for _, _, got, _ in rows.values() for i in got) == list(range(400))  # each unit once
    assert all(nodes == cpu_nodes for _, nodes, _, _ in rows.values()), rows  # loaded on the CPU node
    assert sorted({ip for r in range(4) for ip in rows[r][3]}) == sorted(ray_cluster.gpu_node_ips), rows
    assert wait_until_gone([p.pid for p in job_processes(ray_cluster)], timeout=60) == []


def test_cancel_leaves_no_rank_and_a_killed_host_takes_its_ranks_with_it(kernel, ray_cluster, tmp_path):
    forever = WAITING.format(go=str(tmp_path / "never"))
    job = _detached(kernel.run(forever))
    wait_for(lambda: len(job_processes(ray_cluster)) >= 2, timeout=120, what="the ranks running")
    ranks = [p.pid for p in job_processes(ray_cluster)]
    cancelled = kernel.run(f"%taas cancel {job}")
    assert f"taas: job {job} cancelled" in cancelled.stdout, (cancelled.stdout, cancelled.traceback)
    assert wait_until_gone(ranks, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert "nothing to cancel" in one_line_usage_error(kernel.run(f"%taas cancel {job}"))

    first = job
    job = _detached(kernel.run(forever.replace("--detach", "--detach --fresh")))
    wait_for(lambda: len(job_processes(ray_cluster)) >= 2, timeout=120, what="the ranks running")
    ranks = [p.pid for p in job_processes(ray_cluster)]
    # The second job went to the spare host the kernel made after the first (warm: its imports
    # and agents ready); the record names it, and its pid (inside the cluster) is the one to kill.
    pid, host = _host_of(kernel, job)
    assert host.startswith("taas-spare-"), host
    hosts = [p for p in _hosts(ray_cluster) if inner_pid(p.pid) == pid]
    assert len(hosts) == 1, [(p.pid, inner_pid(p.pid)) for p in _hosts(ray_cluster)]
    hosts[0].send_signal(signal.SIGKILL)
    assert wait_until_gone(ranks, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    listed = kernel.run("%taas jobs")
    assert re.search(rf"{job}\s+lost", listed.stdout), listed.stdout
    assert "ended without a word" in listed.stdout, listed.stdout
    wait_for(lambda: not named(ray_cluster, "taas-rank"), timeout=30, what="no rank anywhere")
    assert placement_groups_left(ray_cluster) == "0"  # the dead host's GPUs are free again
    # A terminal on the cluster's network sees the same records (one Ray connection: kept to one call).
    terminal = ray_cluster.run([sys.executable, "-m", "taas.cli", "--cluster", ray_cluster.address, "jobs"],
                               cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert terminal.returncode == 0, terminal.stderr
    assert re.search(rf"{job}\s+lost", terminal.stdout) and re.search(rf"{first}\s+cancelled", terminal.stdout), \
        terminal.stdout
    for ended in (first, job):  # the records go: nothing of this module is left in the cluster's KV
        assert f"job {ended} forgotten" in kernel.run(f"%taas forget {ended}").stdout
    # The spare made after the second job goes when the kernel lets it go (%unload_ext).
    assert kernel.run("%unload_ext taas").error is None
    wait_for(lambda: not _hosts(ray_cluster), timeout=60, what="the kernel's spare host let go")
    assert kernel.run("%load_ext taas").error is None
    assert kernel.run(f"%taas cluster {ray_cluster.address}").error is None  # as the module's kernel was


KEPT = """%%taas --gpus 2 --keep --detach
import os, time, torch, torch.distributed as dist
state = dist.get_rank() * 10
print("first cell", dist.get_rank(), flush=True)
first = "from the first cell"
"""


def _state(kernel, job: str) -> str:
    listed = kernel.run("%taas jobs")
    assert listed.error is None, listed.traceback
    found = re.search(rf"{job}\s+(\w+)", listed.stdout)
    return found.group(1) if found else ""


def test_kept_ranks_outlive_their_kernel_and_a_new_kernel_adopts_them(kernel, ray_cluster, tmp_path):
    """--keep --detach on the cluster: the host actor keeps the ranks after the first cell; the
    kernel that started them dies; the module's kernel adopts them through the host's door (its
    first cell's names land), runs cells on them with their state, interrupts one (the ranks
    stay), and releases them: ranks, host and GPUs gone."""
    (tmp_path / "first").mkdir()
    first = connected_kernel(ray_cluster, tmp_path / "first")
    try:
        job = _detached(first.run(KEPT))
        wait_for(lambda: _state(kernel, job) == "kept", timeout=120, what="the first cell's end")
        ranks = sorted(p.pid for p in job_processes(ray_cluster))
        assert len(ranks) == 2
        os.kill(first.descendants()[0].pid, signal.SIGKILL)  # the kernel (nsenter's child), its driver
        wait_for(lambda: not first.km.is_alive(), timeout=30, what="the first kernel gone")
    finally:
        first.shutdown()
    assert _state(kernel, job) == "kept"  # the ranks wait for a notebook
    adopted = kernel.run(f"%taas attach {job}")
    assert adopted.error is None, adopted.traceback + adopted.stderr
    assert f"job {job}'s kept ranks (2 on cpu/gloo) are this notebook's now" in adopted.stdout, adopted.stdout
    assert kernel.run("print(first)").stdout.strip() == "from the first cell"
    summed = ok(kernel.run("%%taas\nt = torch.tensor([state + 1.0]); dist.all_reduce(t)\nint(t.item())"))
    assert summed.result == "12"  # 1 + 11: both ranks' state, reduced together
    assert sorted(p.pid for p in job_processes(ray_cluster)) == ranks

    seen: dict = {}

    def on_output(out):  # both ranks in the loop: interrupt now
        if all(f"[rank{r}] spinning" in per_rank(out.stdout) for r in range(2)) and "at" not in seen:
            seen["at"] = True
            kernel.km.interrupt_kernel()

    run = kernel.run("%%taas\nprint('spinning', flush=True)\nwhile True:\n    time.sleep(0.05)",
                     on_output=on_output)
    assert "at" in seen, run.stdout + run.stderr
    assert run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.stderr + run.traceback
    assert sorted(p.pid for p in job_processes(ray_cluster)) == ranks  # the ranks and their state stay
    assert ok(kernel.run("%%taas\nstate")).result == "0"

    pid, _ = _host_of(kernel, job)
    host = [p for p in _hosts(ray_cluster) if inner_pid(p.pid) == pid]
    assert len(host) == 1
    released = kernel.run("%taas release")
    assert f"of job {job}" in released.stdout and "released the kept ranks" in released.stdout, released.stdout
    assert wait_until_gone(ranks + [host[0].pid], timeout=30) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert _state(kernel, job) == "done"
    wait_for(lambda: placement_groups_left(ray_cluster) == "0", timeout=30, what="the job's GPUs given back")
    assert f"job {job} forgotten" in kernel.run(f"%taas forget {job}").stdout


def test_a_cancel_ends_kept_ranks_on_the_cluster(kernel, ray_cluster):
    job = _detached(kernel.run(KEPT))
    wait_for(lambda: _state(kernel, job) == "kept", timeout=120, what="the first cell's end")
    ranks = [p.pid for p in job_processes(ray_cluster)]
    cancelled = kernel.run(f"%taas cancel {job}")
    assert f"taas: job {job} cancelled" in cancelled.stdout, (cancelled.stdout, cancelled.traceback)
    assert wait_until_gone(ranks, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert _state(kernel, job) == "cancelled"
    assert f"job {job} forgotten" in kernel.run(f"%taas forget {job}").stdout
