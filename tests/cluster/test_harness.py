"""The simulated Ray cluster the multi-machine tests run on (tests/support/cluster.py) is what it claims:
four nodes at their own loopback addresses with the right resources, reachable from drivers and
kernels inside its namespace, invisible outside it, and gone after stop()."""

import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from tests.support.cluster import ClusterError, SimulatedCluster, missing_requirements
from tests.support.kernel_driver import cell, wait_for, wait_until_gone

pytestmark = pytest.mark.cluster

# A driver inside the namespace: prints one JSON line, the value of the expression ``RESULT``.
DRIVER = """
import json, ray
ray.init(address="127.0.0.1:6379", log_to_driver=False)
{body}
print("RESULT " + json.dumps(RESULT))
"""


def driver(cluster, body: str, cwd):
    """Run a Ray driver inside the cluster's namespace; the JSON value it computed."""
    run = cluster.run([sys.executable, "-c", DRIVER.format(body=cell(body))], cwd=cwd,
                      capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout + run.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_four_nodes_alive_at_their_addresses_with_their_resources(ray_cluster, tmp_path):
    nodes = driver(ray_cluster, """
        RESULT = [(n["NodeManagerAddress"], n["Alive"], n["Resources"]) for n in ray.nodes()]
    """, tmp_path)
    assert all(alive for _, alive, _ in nodes), nodes
    by_ip = {ip: resources for ip, _, resources in nodes}
    assert sorted(by_ip) == ["127.0.0.1", "127.0.1.1", "127.0.1.2", "127.0.2.1"]
    assert len(nodes) == 4
    assert "CPU" not in by_ip["127.0.0.1"] and "GPU" not in by_ip["127.0.0.1"]
    for ip in ray_cluster.gpu_node_ips:
        assert by_ip[ip]["GPU"] == 2 and by_ip[ip]["gpu_node"] == 1 and by_ip[ip]["CPU"] == 2
        assert "cpu_node" not in by_ip[ip]
    for ip in ray_cluster.cpu_node_ips:
        assert by_ip[ip]["cpu_node"] == 1 and by_ip[ip]["CPU"] == 2 and "GPU" not in by_ip[ip]
    for resources in by_ip.values():
        assert resources["object_store_memory"] == 300_000_000


def test_a_task_asking_for_a_gpu_node_runs_on_one_and_knows_where(ray_cluster, tmp_path):
    """What a launcher needs from inside a task or actor: its node's IP and id (the IP is the
    node's --node-ip-address, not one found by probing the network) and the GPUs Ray gave it."""
    result = driver(ray_cluster, """
        import os

        def where():
            context = ray.get_runtime_context()
            return {"ip": ray.util.get_node_ip_address(), "node_id": context.get_node_id(),
                    "gpus": ray.get_gpu_ids(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}

        task = ray.remote(num_cpus=1, num_gpus=1, resources={"gpu_node": 1})(where)
        Actor = ray.remote(num_cpus=1, num_gpus=1, resources={"gpu_node": 1})(
            type("Actor", (), {"where": lambda self: where()}))
        actor = Actor.remote()
        from_actor = ray.get(actor.where.remote())
        ray.kill(actor)
        ids = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        RESULT = {"task": ray.get(task.remote()), "actor": from_actor, "ids": ids}
    """, tmp_path)
    for where in (result["task"], result["actor"]):
        assert where["ip"] in ray_cluster.gpu_node_ips, where
        assert result["ids"][where["node_id"]] == where["ip"], (where, result["ids"])
        assert len(where["gpus"]) == 1 and where["cuda"] == str(where["gpus"][0]), where


def test_nothing_listens_outside_the_namespace(ray_cluster, tmp_path):
    inside = {p.pid for p in ray_cluster.processes()}
    assert len(inside) > 10  # init, gcs_server, raylets, ...: the check below looks at them
    outside = [c for c in psutil.net_connections(kind="inet") if c.pid in inside]
    assert outside == []
    # ...while inside, the head's port is open (this test's loopback is another one).
    probe = ray_cluster.run([sys.executable, "-c", cell("""
        import socket
        socket.create_connection(("127.0.0.1", 6379), timeout=10).close()
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr


@pytest.mark.kernel
def test_a_kernel_inside_the_namespace_connects_to_the_cluster(ray_cluster, tmp_path):
    kernel = ray_cluster.kernel(str(tmp_path), load_taas=False)
    try:
        kernel_pid = kernel.descendants()[0].pid  # nsenter's child: the kernel itself
        assert kernel_pid in {p.pid for p in ray_cluster.processes()}
        run = kernel.run(cell("""
            import ray
            ray.init(address="127.0.0.1:6379", log_to_driver=False)
            print(len(ray.nodes()))
        """))
        assert run.error is None, run.traceback
        assert run.stdout.strip().splitlines()[-1] == "4", run.stdout + run.stderr
        # Interrupts reach it through nsenter's process group.
        msg_id = kernel.execute("import time; time.sleep(600)")
        wait_for(lambda: kernel.kc.get_iopub_msg(timeout=60)["msg_type"] == "execute_input",
                 what="the sleeping cell to start")
        kernel.km.interrupt_kernel()
        reply = kernel.reply(msg_id, timeout=60)
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert kernel.km.is_alive()  # nsenter, the manager's process, outlived the interrupt
        after = kernel.run("print(ray.is_initialized())")
        assert after.stdout.strip() == "True", (after.status, after.stdout, after.stderr)
    finally:
        kernel.shutdown()
    assert wait_until_gone([kernel_pid], timeout=30) == []


def test_stop_leaves_no_process_of_the_namespace(tmp_path):
    """A cluster of its own (a head and one node): stop() ends its nodes and whatever was
    started inside, and removes its temp dirs."""
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    cluster = SimulatedCluster(gpu_nodes=1, cpu_nodes=0).start()
    try:
        sleeper = cluster.popen(["sleep", "600"], cwd=tmp_path)
        wait_for(lambda: len(psutil.Process(sleeper.pid).children()) == 1,
                 what="the command entered into the namespace")
        inside = cluster.processes()
        assert psutil.Process(sleeper.pid).children()[0] in inside
        base = cluster.base
    finally:
        cluster.stop()
    assert wait_until_gone([p.pid for p in inside], timeout=10) == []
    assert sleeper.wait(timeout=60) != 0  # nsenter reports its command's death by SIGKILL
    assert not os.path.exists(base)
    assert cluster.processes() == []


OWNER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from tests.support.cluster import SimulatedCluster
cluster = SimulatedCluster(gpu_nodes=0, cpu_nodes=0).start()
child = os.fork()  # holds the init's stdin pipe open after the owner dies, and prints its pid
if child == 0:
    os.setsid()
    sys.stdin.read()
    os._exit(0)
print(cluster.pid, cluster.base, child, flush=True)
sys.stdin.read()
"""


def test_the_cluster_ends_when_its_owner_dies(tmp_path):
    """A test session killed outright (no stop()) leaves no Ray process running, even when a
    process it forked still holds the init's stdin open: unshare dies with its parent (a
    parent-death signal) and takes the init along."""
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, repo], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    base = child = None
    try:
        pid, base, child = owner.stdout.readline().split()
        ns = os.readlink(f"/proc/{pid}/ns/pid")
        inside = [p for p in psutil.process_iter() if _pid_ns(p.pid) == ns]
        assert len(inside) > 3, inside  # the init, gcs_server, raylet, ...
        owner.kill()
        owner.wait()
        assert wait_until_gone([p.pid for p in inside], timeout=60) == []
    finally:
        owner.kill()
        owner.wait()
        if child:  # ours: the owner forked it; it ends with its stdin or now
            try:
                os.kill(int(child), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if base:
            shutil.rmtree(base, ignore_errors=True)  # stop() never ran to remove it


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:  # ended, or not ours to read
        return None


def test_a_failed_start_says_why_and_leaves_nothing(monkeypatch):
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    monkeypatch.setattr("tests.support.cluster._ray_executable", lambda: "false")  # `false start ...`
    cluster = SimulatedCluster()
    with pytest.warns(UserWarning, match="start 1 failed, retrying"):
        with pytest.raises(ClusterError, match="ray start --head failed"):
            cluster.start()
    assert len(cluster.failures) == 2
    assert cluster.pid is None and cluster.base is None
