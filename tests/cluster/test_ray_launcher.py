"""The Ray launcher on a real one-node Ray cluster, in a private network and PID namespace.

The cluster (``ray start --head --num-gpus 2`` on 127.0.0.1, a CPU machine pretending to have
two GPUs) runs under its own init inside ``unshare --net --pid``: its sockets are on a private
loopback, and killing that init ends every Ray process, ours only.  A driver
(``tests/support/ray_driver.py``) runs inside the namespaces (``nsenter``) and drives
:class:`taas.session.Session` on the cluster, as a kernel would; it reports as JSON what it saw.
One driver run covers every scenario (connecting and starting the agents is the slow part).

Two nodes (4 ranks over 2 "GPU" nodes, loader workers on CPU nodes) need the simulated cluster
harness; this file checks what one node can show.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support.cluster import missing_namespaces, write_auth_token
from tests.support.paths import REPO_ROOT, with_repo_on_path
from tests.support.ranks import per_rank


def _why_skip() -> str | None:
    reason = missing_namespaces()
    if reason:
        return reason
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")

# The namespace's init: loopback up, a head node, then reap orphans (an init that does not
# reap piles up zombies).
INIT = """
import os, subprocess, sys, time
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
ray = os.path.join(os.path.dirname(sys.executable), "ray")
temp = sys.argv[1]
code = subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", "6379",
                       "--num-gpus", "2", "--num-cpus", "4", "--temp-dir", os.path.join(temp, "ray"),
                       "--include-dashboard=false", "--disable-usage-stats",
                       "--object-store-memory=300000000"],
                      stdout=open(os.path.join(temp, "ray.log"), "w"), stderr=subprocess.STDOUT).returncode
open(os.path.join(temp, "started.tmp"), "w").write(str(code))
os.rename(os.path.join(temp, "started.tmp"), os.path.join(temp, "started"))
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="taas-ray-", dir="/tmp")  # short: Ray's socket paths
    # Token authentication, as a production cluster has it (and never the user's ~/.ray token).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(write_auth_token(temp))
    # TMPDIR: what taas's agents keep in the node's temporary directory (job directories, their
    # watchers' records) stays in ours, removed with it even when the namespace is killed at once.
    env["TMPDIR"] = temp
    proc = subprocess.Popen(["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child",
                             sys.executable, "-c", INIT, temp],
                            start_new_session=True, stdin=subprocess.DEVNULL, env=env)
    try:
        started = os.path.join(temp, "started")
        deadline = time.monotonic() + 180
        while not os.path.exists(started):
            assert proc.poll() is None, "the namespace's init ended"
            assert time.monotonic() < deadline, "the Ray head did not start in 180 s"
            time.sleep(0.2)
        with open(started) as f:
            code = f.read()
        if code != "0":
            with open(os.path.join(temp, "ray.log")) as f:
                pytest.fail(f"ray start failed ({code}):\n{f.read()[-3000:]}")
        (init,) = _children(proc.pid)
        yield init, temp
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # --kill-child: the init and all Ray go with it
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def inside(init: int, *args: str) -> list[str]:
    """A ``python -m tests.support.ray_driver ARGS`` command line that runs inside the namespaces."""
    return ["nsenter", "--target", str(init), "--net", "--pid", "--mount", f"--wd={REPO_ROOT}",
            sys.executable, "-m", "tests.support.ray_driver", *args]


def driver_env(temp: str) -> dict:
    """The driver's environment: this one, taas importable, the cluster's token (what a user of
    a token-authenticated cluster has), no other RAY_ settings."""
    env = with_repo_on_path({k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=os.path.join(temp, "auth_token"), TMPDIR=temp)
    return env


@pytest.fixture(scope="module")
def report(cluster):
    init, temp = cluster
    workdir = os.path.join(temp, "notebook")
    os.mkdir(workdir)
    run = subprocess.run(inside(init, "127.0.0.1:6379", workdir), env=driver_env(temp),
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the driver reported nothing (code {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    out = json.loads(lines[-1][len("REPORT "):])
    assert "crash" not in out, out["crash"]
    return out


def ranks_env(lines):
    import ast

    return {int(env["RANK"]): env for env in
            (ast.literal_eval(line.split("ENV ", 1)[1]) for line in lines if "ENV " in line)}


def test_percent_taas_shows_the_cluster(report):
    text = "\n".join(report["describe"])
    assert "Ray cluster at 127.0.0.1:6379: 2 GPUs (2 on 127.0.0.1), 4 CPUs on 1 node" in text
    assert "ranks see no CUDA device" in text


def test_ranks_get_torchruns_environment_and_the_node_id(report):
    run = report["env"]
    assert run.get("error") is None, run
    env = ranks_env(run["lines"])
    assert sorted(env) == [0, 1]
    node = env[0]["TAAS_NODE_ID"]
    assert len(node) == 56 and env[1]["TAAS_NODE_ID"] == node  # Ray's hex node id
    for rank in (0, 1):
        assert env[rank]["LOCAL_RANK"] == str(rank)
        assert env[rank]["GROUP_RANK"] == env[rank]["NODE_RANK"] == "0"
        assert env[rank]["LOCAL_WORLD_SIZE"] == env[rank]["WORLD_SIZE"] == "2"
        assert env[rank]["MASTER_ADDR"] == "127.0.0.1"
        assert env[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert run["values"]["total"] == "3.0" and run["values"]["backend"] == "'gloo'"
    assert "taas: no CUDA device on the cluster: running 2 CPU ranks on gloo" in run["lines"]
    assert run["leftovers"] == []


def test_output_is_live(report):
    run = report["live"]
    assert run.get("error") is None, run
    assert "[rank0] second line" in per_rank("\n".join(run["lines"])).splitlines(), run["lines"]


def test_a_failing_rank_is_the_root_cause(report):
    run = report["fail"]
    assert run["error"] == "JobFailed", run
    assert "ValueError: boom on rank 1" in run["summary"] and "rank1" in run["summary"], run["summary"]
    assert run["exit_codes"]["rank1"] != 0
    assert run["leftovers"] == []


def test_restart_runs_a_fresh_attempt(report):
    run = report["restart"]
    assert run.get("error") is None, run
    assert run["values"]["done"] == "1"
    assert any("restart 1/1" in line and "first attempt fails" in line for line in run["lines"]), run["lines"]
    assert run["leftovers"] == []


def test_more_gpus_than_the_cluster_has_is_one_line(report):
    run = report["too_many"]
    assert run["error"] == "LaunchError"
    assert run["summary"].startswith("--gpus 3 asks for more GPUs than the cluster has (2 GPUs"), run["summary"]
    assert "\n" not in run["summary"]


def test_a_registered_loader_feeds_the_ranks(report):
    run = report["loader"]
    lines = per_rank("\n".join(run["lines"])).splitlines()  # identical lines of both ranks collapse
    counts = [int(line.split("COUNT ")[1]) for line in lines if "COUNT " in line]
    assert sum(counts) == 8, run["lines"]
    nodes = {line.split("WORKER_NODE ")[1] for line in lines if "WORKER_NODE " in line}
    assert len(nodes) == 1 and len(nodes.pop()) == 56, run["lines"]


def test_a_dead_agent_ends_its_ranks_and_the_next_job_runs(report):
    run = report["agent_death"]
    assert run["error"] == "JobFailed", run
    assert set(run["exit_codes"].values()) == {-9}, run["exit_codes"]
    assert run["leftovers"] == []
    again = report["after_agent_death"]
    assert again.get("error") is None and again["values"]["total"] == "3.0", again


def test_nothing_is_left_after_the_session_closes(report):
    assert report["agents_alive_after_close"] == []
    assert report["leftovers_after_close"] == []


def test_warm_jobs_ran(report):
    print("warm 2-rank jobs on a one-node cluster (s):", ", ".join(f"{t:.2f}" for t in report["warm"]))
    assert len(report["warm"]) == 5


def test_a_killed_kernel_takes_its_agents_and_ranks_along(cluster, report):
    """The agents are owned by the kernel's Ray connection: when the kernel dies, Ray ends them,
    and their start processes take the ranks along.  (Runs after the other scenarios.)"""
    init, temp = cluster
    driver = subprocess.Popen(inside(init, "--orphan", "127.0.0.1:6379", os.path.join(temp, "notebook")),
                              env=driver_env(temp), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, start_new_session=True)
    try:
        pids = None
        for line in driver.stdout:
            if line.startswith("PIDS "):
                pids = json.loads(line[len("PIDS "):])
                break
        assert pids, "the driver's job never started"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # nsenter and the driver below it: the "kernel"
        driver.wait()
    check = subprocess.run(inside(init, "--wait-gone", json.dumps(pids), "60"), env=driver_env(temp),
                           capture_output=True, text=True, timeout=120)
    left = [line for line in check.stdout.splitlines() if line.startswith("LEFT ")]
    assert left == ["LEFT []"], check.stdout + check.stderr
