"""The Ray launcher as data, on a fake ``ray`` (conftest.py): the topology it plans, where
start() puts each process, what it refuses, and which address the kernel is reached at."""

from __future__ import annotations

import json
import socket

import pytest

from taas.errors import LaunchError
from taas.io import keys
from taas.launch.api import LaunchSpec, ProcessExit, ProcessSpec, Topology, error_name
from taas.launch.ray import launcher as ray_launcher
from taas.launch.ray.launcher import RayLauncher
from taas.launch.ray.placement import Node

# Two GPU nodes listed out of IP order, two CPU nodes, a head that only coordinates.
CLUSTER = [Node("head", "10.0.0.1"), Node("b", "10.0.1.2", gpus=2, cpus=8),
           Node("d", "10.0.2.2", cpus=4), Node("a", "10.0.1.1", gpus=2, cpus=8),
           Node("c", "10.0.2.1", cpus=4)]


@pytest.fixture
def cluster(fake_ray):
    fake_ray.set_nodes(CLUSTER)
    return fake_ray


def ranks(n: int) -> list[ProcessSpec]:
    return [ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r, env={"MINE": "1"}) for r in range(n)]


def relays(n: int) -> list[ProcessSpec]:
    return [ProcessSpec(key=keys.relay_key(g), entry="m:relay", role=keys.RELAY, node=g, storage="strict")
            for g in range(n)]


def loaders(n: int) -> list[ProcessSpec]:
    return [ProcessSpec(key=keys.loader_key("train", w), entry="m:load", role=keys.LOADER, storage="strict")
            for w in range(n)]


def spec(tmp_path, processes, **kw) -> LaunchSpec:
    return LaunchSpec("job1", str(tmp_path), tuple(processes), files={"payload.pkl": b"x"}, **kw)


def started(fake_ray) -> dict[str, list[str]]:
    """node id -> the keys its agent was asked to start (last start)."""
    return {n: [p.key for p in agent.started[-1].processes]
            for n, agent in fake_ray.agents.items() if agent.started}


def test_topology_packs_the_ranks_onto_gpu_nodes_in_ip_order(cluster):
    launcher = RayLauncher("auto", workdir="shared")
    assert launcher.topology(4) == Topology(rank_nodes=(0, 0, 1, 1), node_ids=("a", "b"),
                                            host="10.9.9.9", kernel_machine=False)
    assert launcher.topology(2) == Topology(rank_nodes=(0, 0), node_ids=("a",), host="10.9.9.9",
                                            kernel_machine=False)
    assert launcher.topology(0).node_ids == ("a",)  # no ranks: still a node for the transport


def test_dead_nodes_are_no_nodes(cluster):
    cluster.set_nodes(CLUSTER, dead=("a",))
    assert RayLauncher("auto").topology(2).node_ids == ("b",)


def test_start_places_ranks_relays_and_loader_workers(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    launcher.topology(4)
    job = launcher.start(spec(tmp_path, ranks(4) + relays(2) + loaders(3)))
    assert started(cluster) == {
        "a": ["rank0", "rank1", "data-relay:0"],
        "b": ["rank2", "rank3", "data-relay:1"],
        "c": ["loader:train:0", "loader:train:2"],  # CPU nodes round robin; the head has no CPU
        "d": ["loader:train:1"],
    }
    assert job.keys == ["rank0", "rank1", "rank2", "rank3", "data-relay:0", "data-relay:1",
                        "loader:train:0", "loader:train:1", "loader:train:2"]
    assert cluster.agents["a"].called("host_store") == [("job1", 4)]  # node 0 hosts the store
    rank2 = cluster.agents["b"].started[-1].processes[0]
    assert {k: rank2.env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                                      "MASTER_ADDR", "MASTER_PORT", "MINE")} == {
        "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "GROUP_RANK": "1", "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.1.1", "MASTER_PORT": "29500", "MINE": "1"}
    relay = cluster.agents["b"].started[-1].processes[2]
    assert relay.env == {} and relay.node == 1  # a relay gets no rendezvous
    share = cluster.agents["c"].started[-1]
    assert share.placed and share.files == {} and share.job_id == "job1" and share.cwd == str(tmp_path)
    job.close()


def test_the_job_merges_its_nodes_events(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    job = launcher.start(spec(tmp_path, ranks(4) + loaders(1)))
    exits = {e.key: e.returncode for e in job.drain(1.0) if isinstance(e, ProcessExit)}
    assert exits == {"rank0": 0, "rank1": 0, "rank2": 0, "rank3": 0, "loader:train:0": 0}
    assert job.events(0) == []
    job.close()
    assert all(agent.called("close") for agent in cluster.agents.values())
    assert cluster.agents["a"].called("close_store") == [("job1",)]


def test_start_refuses_when_the_nodes_changed_since_the_topology(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    launcher.topology(2)  # planned on node a
    cluster.set_nodes([n for n in CLUSTER if n.node_id != "a"])
    with pytest.raises(LaunchError) as info:
        launcher.start(spec(tmp_path, ranks(2) + relays(1)))
    assert str(info.value) == "the cluster's nodes changed while the job was prepared; run the cell again"
    assert started(cluster) == {}


def test_a_kept_cells_loader_job_puts_its_relays_beside_the_kept_ranks(cluster, tmp_path):
    """--keep: a cell's loader job has relays and workers but no rank; its relays go to the
    GPU nodes the topology planned (the kept ranks'), and it reserves no GPU of its own."""
    launcher = RayLauncher("auto", workdir="shared")
    launcher.topology(4)
    kept = launcher.start(spec(tmp_path, ranks(4)))
    held = list(cluster.groups.held)
    data = launcher.start(LaunchSpec("job2-data", str(tmp_path), tuple(relays(2) + loaders(2)), files={}))
    assert {n: [p.key for p in a.started[-1].processes] for n, a in cluster.agents.items()
            if a.started and a.started[-1].job_id == "job2-data"} == {
        "a": ["data-relay:0"], "b": ["data-relay:1"], "c": ["loader:train:0"], "d": ["loader:train:1"]}
    assert cluster.groups.held == held and len(held) == 1  # the kept ranks' reservation only
    assert cluster.agents["a"].called("host_store") == [("job1", 4)]  # no store for no rank
    data.close()
    assert cluster.groups.held == held  # the loader job's end leaves the kept ranks' GPUs held
    assert ("close", ("job2-data",)) in cluster.agents["a"].calls  # its own job only
    launcher.topology(2)  # planned on node a
    cluster.set_nodes([n for n in CLUSTER if n.node_id != "a"])
    with pytest.raises(LaunchError, match="nodes changed"):  # a went since: its relay would serve no rank
        launcher.start(LaunchSpec("job3-data", str(tmp_path), tuple(relays(1) + loaders(1)), files={}))
    kept.close()


def test_a_job_without_a_transport_needs_no_topology(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    launcher.topology(2)
    cluster.set_nodes([n for n in CLUSTER if n.node_id != "a"])
    launcher.start(spec(tmp_path, ranks(2))).close()  # nothing was made for the old placement
    assert started(cluster) == {"b": ["rank0", "rank1"]}


def test_cuda_ranks_need_cuda_devices_on_their_node(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    cluster.agent_for("a", "10.0.1.1").cuda = 1
    with pytest.raises(LaunchError) as info:
        launcher.start(spec(tmp_path, ranks(2), device="cuda"))
    assert str(info.value) == "node 10.0.1.1 runs 2 CUDA rank(s) but its processes see 1 CUDA device(s)"
    assert launcher.cuda_devices() == 0  # node b's ranks would see none: the job runs gloo
    cluster.agents["a"].cuda = cluster.agents["b"].cuda = 2
    assert launcher.cuda_devices() == 0  # the agents' answers are kept ...
    launcher.cluster.forget("a")
    launcher.cluster.forget("b")  # ... until the agents go
    assert launcher.cuda_devices() == 4


def test_a_dead_agent_fails_the_start_in_one_line_and_is_started_afresh(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    dead = cluster.agent_for("b", "10.0.1.2")
    dead.dead = True
    with pytest.raises(LaunchError) as info:
        launcher.start(spec(tmp_path, ranks(4)))
    assert str(info.value) == ("could not start the job: node 10.0.1.2: "
                               "The actor died unexpectedly on node 10.0.1.2")
    assert dead in cluster.killed
    assert cluster.groups.held == []  # the failed job gave its GPUs back
    del cluster.agents["b"]
    launcher.start(spec(tmp_path, ranks(4))).close()
    assert cluster.started_agents.count("b") == 2


def test_processes_of_a_lost_agent_exit_with_minus_9_and_say_where(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    agent = cluster.agent_for("b", "10.0.1.2")
    agent.do_events = lambda timeout, attempt=None: ([], False)  # b's ranks run on
    job = launcher.start(spec(tmp_path, ranks(4)))
    agent.dead = True
    exits = {}
    for _ in range(5):
        exits.update({e.key: e.returncode for e in job.events(0) if isinstance(e, ProcessExit)})
    assert exits == {"rank0": 0, "rank1": 0, "rank2": -9, "rank3": -9}
    report = json.loads(job.fetch("rank2", error_name("rank2")))
    assert report["exit_code"] == -9 and "lost with node 10.0.1.2" in report["message"]
    assert job.fetch("rank2", "result.pkl") is None
    assert agent in cluster.killed
    job.close()


def test_kernel_ip_of_a_ray_driver_is_its_nodes(fake_ray):
    assert RayLauncher("auto")._kernel_ip(fake_ray) == "10.9.9.9"


def test_kernel_ip_through_ray_client_faces_the_client_server(fake_ray):
    fake_ray.client.is_connected = lambda: True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert RayLauncher(f"ray://127.0.0.1:{port}")._kernel_ip(fake_ray) == "127.0.0.1"
        # The user connected (ray.init("ray://...") before taas): the client knows where.
        worker = type("Worker", (), {"_conn_str": f"127.0.0.1:{port}"})()
        fake_ray.client.get_context = lambda: type("Context", (), {"client_worker": worker})()
        assert RayLauncher("auto")._kernel_ip(fake_ray) == "127.0.0.1"


def test_client_server_address(fake_ray):
    server = ray_launcher._client_server
    assert server(fake_ray, "ray://head:10001") is None  # not connected through a client
    fake_ray.client.is_connected = lambda: True
    assert server(fake_ray, "ray://head") == ("head", 10001)
    assert server(fake_ray, "ray://10.0.0.1:12345") == ("10.0.0.1", 12345)
    assert server(fake_ray, "ray://[::1") is None  # malformed


def test_check_and_describe(cluster):
    launcher = RayLauncher("auto", workdir="copy", workdir_limit=1 << 20)
    launcher.check(6, ranks=4)
    with pytest.raises(LaunchError, match="--gpus 5 asks for more GPUs than the cluster has"):
        launcher.check(5)
    lines = launcher.describe()
    assert lines[0] == ("taas: Ray cluster at auto: 4 GPUs (2 on 10.0.1.1, 2 on 10.0.1.2), "
                        "24 CPUs on 5 nodes; ranks see no CUDA device: they run on CPU with gloo, "
                        "one per GPU slot")
    assert lines[1].startswith("  node 10.0.0.1 ") and lines[-1].endswith("(--workdir copy)")


def test_shutdown_ends_jobs_agents_and_the_connection_it_made(cluster, tmp_path):
    launcher = RayLauncher("auto", workdir="shared")
    job = launcher.start(spec(tmp_path, ranks(2)))
    assert cluster.initialized
    launcher.shutdown()
    assert job.closed and not cluster.initialized and cluster.groups.held == []
    assert cluster.agents["a"].called("shutdown") and cluster.agents["a"] in cluster.killed
    launcher.shutdown()  # twice is fine


def test_a_connection_the_user_made_is_left_open(cluster):
    cluster.initialized = True
    launcher = RayLauncher("auto")
    launcher.nodes()
    launcher.shutdown()
    assert cluster.initialized
