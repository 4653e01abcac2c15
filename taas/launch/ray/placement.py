"""Which node of a cluster runs each process of a job: pure, tested as data (no Ray).

Given the cluster's nodes (:class:`Node`: id, IP, GPUs, CPUs as Ray counts them) and the job
(ranks, loader workers), :func:`plan` returns a :class:`Plan`:

- **ranks** take one GPU each and are *packed*: as few GPU nodes as hold them (the nodes with
  the most GPUs first, then by IP), so that ranks talk over NVLink/shared memory where they
  can.  The chosen nodes are then ordered by IP -- the order torch's elastic agent and Ray
  Train give node ranks -- and ranks are numbered node after node: node ``g`` (``GROUP_RANK``)
  holds a contiguous block of global ranks, ``LOCAL_RANK`` counts within it.  This is a
  count of Ray's ``GPU`` resource, whatever the ranks' device: on a cluster whose nodes
  advertise GPUs that torch cannot see (a simulated cluster) the ranks run gloo on CPU, placed
  as they would be on GPUs.  A cluster without any GPU places ranks by CPUs, the same way.
- **loader workers** go round-robin over the nodes without GPUs when the cluster has both
  kinds (so they do not take the CPUs that feed the GPUs; a node without CPUs -- a head that
  only coordinates -- takes none), else over the ranks' nodes.

Asking for more than the cluster has is a one-line :class:`~taas.errors.LaunchError` that says
what the cluster has.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from taas.errors import LaunchError
from taas.launch.rendezvous import Placement


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    gpus: float = 0.0
    cpus: float = 0.0


@dataclass(frozen=True)
class Plan:
    """``rank_nodes[r]``: the node id of global rank ``r``; ``places[r]``: its rendezvous
    place; ``worker_nodes[i]``: the node id of loader worker ``i``; ``nodes``: the ranks'
    nodes in group-rank order (node 0 hosts the rendezvous store)."""

    rank_nodes: tuple[str, ...]
    places: tuple[Placement, ...]
    worker_nodes: tuple[str, ...]
    nodes: tuple[Node, ...]
    by: str  # "GPU" or "CPU": the resource each rank takes


def ip_key(ip: str):
    """Sort key of an IP address (numeric: 10.0.0.9 before 10.0.0.10); non-IPs sort last."""
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def describe(nodes: list[Node]) -> str:
    """What the cluster has, in a few words: ``4 GPUs (2 on 127.0.1.1, 2 on 127.0.1.2), 12 CPUs
    on 3 nodes``."""
    nodes = sorted(nodes, key=lambda n: ip_key(n.ip))
    gpu_nodes = [n for n in nodes if int(n.gpus) >= 1]
    gpus = sum(int(n.gpus) for n in gpu_nodes)
    cpus = sum(int(n.cpus) for n in nodes)
    where = ", ".join(f"{int(n.gpus)} on {n.ip}" for n in gpu_nodes[:4])
    if len(gpu_nodes) > 4:
        where += f", ... ({len(gpu_nodes)} GPU nodes)"
    text = f"{gpus} GPU{'s' * (gpus != 1)}" + (f" ({where})" if gpu_nodes else "")
    return text + f", {cpus} CPU{'s' * (cpus != 1)} on {len(nodes)} node{'s' * (len(nodes) != 1)}"


def plan(nodes: list[Node], ranks: int, workers: int = 0) -> Plan:
    """Place ``ranks`` ranks and ``workers`` loader workers on ``nodes`` (see the module)."""
    if not nodes:
        raise LaunchError("the cluster has no live node")
    gpu_nodes = [n for n in nodes if int(n.gpus) >= 1]
    by = "GPU" if gpu_nodes else "CPU"
    pool = gpu_nodes or [n for n in nodes if int(n.cpus) >= 1]

    def slots(n: Node) -> int:
        return int(n.gpus) if by == "GPU" else int(n.cpus)

    total = sum(slots(n) for n in pool)
    if ranks > total:
        raise LaunchError(
            f"--gpus {ranks} asks for more {by}s than the cluster has ({describe(nodes)}); "
            f"use --gpus {total} or fewer" if total else
            f"--gpus {ranks}: the cluster has no GPU and no CPU to run ranks on ({describe(nodes)})")
    chosen: list[tuple[Node, int]] = []
    left = ranks
    for node in sorted(pool, key=lambda n: (-slots(n), ip_key(n.ip))):
        if left <= 0:
            break
        take = min(left, slots(node))
        chosen.append((node, take))
        left -= take
    chosen.sort(key=lambda pair: ip_key(pair[0].ip))
    rank_nodes: list[str] = []
    places: list[Placement] = []
    for group, (node, count) in enumerate(chosen):
        for local in range(count):
            places.append(Placement(len(places), local, count, group, len(chosen)))
            rank_nodes.append(node.node_id)
    cpu_only = [n for n in nodes if int(n.gpus) < 1 and int(n.cpus) >= 1]  # not a head without CPUs
    feeders = sorted(cpu_only if gpu_nodes and cpu_only else [n for n, _ in chosen] or nodes,
                     key=lambda n: ip_key(n.ip))
    worker_nodes = tuple(feeders[i % len(feeders)].node_id for i in range(workers))
    return Plan(tuple(rank_nodes), tuple(places), worker_nodes, tuple(n for n, _ in chosen), by)
