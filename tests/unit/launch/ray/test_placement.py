"""Placement on a cluster as data: which node runs each process, and each rank's torchrun place."""

import pytest

from taas.errors import LaunchError
from taas.launch.ray.placement import Node, describe, plan

GPU_A = Node("a", "127.0.1.1", gpus=2, cpus=2)
GPU_B = Node("b", "127.0.1.2", gpus=2, cpus=2)
GPU_BIG = Node("big", "127.0.1.9", gpus=4, cpus=8)
CPU_C = Node("c", "127.0.2.1", cpus=4)
CPU_D = Node("d", "127.0.2.2", cpus=4)
HEAD = Node("head", "127.0.0.1", cpus=1)

SIMULATED = [HEAD, GPU_B, CPU_D, GPU_A, CPU_C]  # in no particular order, as Ray lists them


def table(p):
    """(node, rank, local rank, local world, group rank, group world) per rank."""
    return [(node, pl.rank, pl.local_rank, pl.local_world, pl.group_rank, pl.group_world)
            for node, pl in zip(p.rank_nodes, p.places)]


def test_four_ranks_fill_two_gpu_nodes_in_ip_order():
    p = plan(SIMULATED, 4, 4)
    assert table(p) == [
        ("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 2, 1, 2), ("b", 3, 1, 2, 1, 2),
    ]
    assert [n.node_id for n in p.nodes] == ["a", "b"]  # node 0 hosts the store
    assert p.by == "GPU"


def test_loader_workers_go_to_nodes_without_gpus_round_robin():
    p = plan(SIMULATED, 2, 4)
    # The head has a CPU and no GPU: it counts as a CPU node too (sorted by IP: head first).
    assert p.worker_nodes == ("head", "c", "d", "head")
    assert plan([GPU_A, GPU_B, CPU_C], 2, 3).worker_nodes == ("c", "c", "c")
    coordinator = Node("head", "127.0.0.1")  # a head without CPUs (the simulated cluster's) feeds nothing
    assert plan([coordinator, GPU_A, GPU_B, CPU_C], 4, 2).worker_nodes == ("c", "c")


def test_loader_workers_share_the_rank_nodes_without_cpu_nodes():
    assert plan([GPU_B, GPU_A], 4, 3).worker_nodes == ("a", "b", "a")
    assert plan([GPU_B, GPU_A], 2, 2).worker_nodes == ("a", "a")  # packed: only node a has ranks


@pytest.mark.parametrize("ranks, nodes", [(1, ["a"]), (2, ["a"]), (3, ["a", "b"])])
def test_ranks_pack_onto_as_few_nodes_as_hold_them(ranks, nodes):
    p = plan([GPU_B, GPU_A, CPU_C], ranks)
    assert sorted(set(p.rank_nodes)) == nodes
    assert p.places[-1].group_world == len(nodes)


def test_packing_prefers_the_biggest_node_then_orders_by_ip():
    p = plan([GPU_A, GPU_BIG, GPU_B], 4)
    assert set(p.rank_nodes) == {"big"}
    p = plan([GPU_A, GPU_BIG, GPU_B], 5)  # big (4) + the lowest IP of the rest (a)
    assert table(p) == [
        ("a", 0, 0, 1, 0, 2),
        ("big", 1, 0, 4, 1, 2), ("big", 2, 1, 4, 1, 2), ("big", 3, 2, 4, 1, 2), ("big", 4, 3, 4, 1, 2),
    ]


def test_ip_order_is_numeric():
    ten = Node("ten", "10.0.0.10", gpus=1)
    nine = Node("nine", "10.0.0.9", gpus=1)
    assert plan([ten, nine], 2).rank_nodes == ("nine", "ten")


def test_without_any_gpu_ranks_take_cpus():
    p = plan([CPU_D, CPU_C], 6)
    assert p.by == "CPU"
    assert table(p) == [("c", r, r, 4, 0, 2) for r in range(4)] + [("d", 4, 0, 2, 1, 2), ("d", 5, 1, 2, 1, 2)]


@pytest.mark.parametrize("nodes, ranks, mentions", [
    (SIMULATED, 5, ("--gpus 5 asks for more GPUs than the cluster has (4 GPUs (2 on 127.0.1.1, "
                    "2 on 127.0.1.2), 13 CPUs on 5 nodes); use --gpus 4 or fewer")),
    ([GPU_A], 3, "(2 GPUs (2 on 127.0.1.1), 2 CPUs on 1 node)"),
    ([CPU_C], 5, "more CPUs than the cluster has"),
    ([Node("x", "127.0.0.1")], 1, "no GPU and no CPU"),
    ([], 1, "no live node"),
])
def test_too_much_is_one_line_saying_what_the_cluster_has(nodes, ranks, mentions):
    with pytest.raises(LaunchError) as info:
        plan(nodes, ranks)
    assert mentions in str(info.value) and "\n" not in str(info.value)


def test_describe():
    assert describe([CPU_C]) == "0 GPUs, 4 CPUs on 1 node"
    assert describe(SIMULATED) == "4 GPUs (2 on 127.0.1.1, 2 on 127.0.1.2), 13 CPUs on 5 nodes"
