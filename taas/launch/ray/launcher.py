"""The Ray launcher: a job's processes on the nodes of a Ray cluster the user already runs.

    kernel ── RayLauncher ──RayCluster: ray.init(address, log_to_driver=False)──> cluster
                 │  placement.plan(nodes, ranks, workers)      pure: which node, GROUP_RANK...
                 ▼  RayJob (one attempt), given the cluster and the reservation:
                 │  Reservation: {"GPU": 1} per rank, pinned to the planned nodes
                 │  node 0's agent: host_store(world) -> (ip, port)      (MASTER_ADDR/PORT)
                 ▼  per node: agent.start(its ProcessSpecs, env already placed)
             NodeAgent × nodes (taas.launch.ray.agent: a LocalLauncher each, warm; the
                 │               pool of them is RayCluster's, taas.launch.ray.cluster)
                 │  fork from the node's warm start process; pipes to the agent
                 ▼
             ranks, loader workers  ──output──> agent ──events() long poll──> RayJob.events

taas never starts a Ray cluster: ``address`` is what ``ray.init(address=...)`` takes of a
running one (``"auto"``, ``"10.0.0.1:6379"``, ``"ray://HOST:10001"``).  Through Ray Client
(``ray://``) the kernel is no Ray driver: the head's client server runs one for it (a proxy),
which owns the agents; the data hub then listens on the kernel's address towards that server.
If the kernel is already connected (the user called ``ray.init``), that connection is used as
it is.  Ray's own log forwarding is off for a connection taas makes: output travels through the
agents, whole and in order, to the kernel's output router.

Agents are actors owned by the kernel's connection (not detached): they stay warm between
cells and die with it -- and their start processes, ranks and loader workers with them.  An
agent (or node) that dies becomes an exit (-9) of each of its processes; the supervisor stops
the rest at the first failure, and a restart starts a fresh attempt wherever the plan says.

The notebook's working directory: a node that sees it (project storage mounted everywhere, a
simulated cluster) starts its processes there, and the kernel reads the ``--storage layer``
uppers of its ranks from the paths its agent reports.  A node that does not gets a copy, kept
per kernel on the node and updated before each job; after the job, what its processes allowed
to write the directory changed comes back, and its layers travel to the kernel to be merged
(:mod:`taas.workdir.sync`, :mod:`taas.launch.ray.copies`).  ``workdir`` says which nodes are
which: ``"auto"`` (the kernel writes a marker file in the directory and asks each agent whether
it sees it, once per node and directory), ``"shared"`` or ``"copy"`` (every node).

Registered loaders' units travel over TCP (the session picks TCP from
:meth:`RayLauncher.topology`): loader workers on the CPU nodes, a relay on each GPU node of the
job filling its ranks' shared memory.  A kept cell's loader job (``--keep``) has workers and
relays but no rank: its relays go to the GPU nodes of the kept ranks, as the last
:meth:`RayLauncher.topology` planned them, and it reserves no GPU.  The kernel's resident big
tensors travel through the object store, copied once per node.
"""

from __future__ import annotations

import dataclasses
import socket
from urllib.parse import urlsplit

from taas.errors import LaunchError
from taas.io import keys
from taas.launch.api import Launcher, LaunchSpec, Topology
from taas.launch.ray import placement
from taas.launch.ray.cluster import RayCluster, message
from taas.launch.ray.job import RayJob, Workdir
from taas.launch.ray.reservation import Reservation


CHANGED = "the cluster's nodes changed while the job was prepared; run the cell again"


class RayLauncher(Launcher):
    """The Launcher contract on a Ray cluster: check, topology, start, describe, shutdown."""

    where = "the cluster"
    keeps_ranks = True  # RayJob implements the kept-ranks calls (taas.launch.ray.kept)

    def __init__(self, address: str, workdir: str = "auto", workdir_limit: int | None = None):
        self.address = address
        self.workdir = workdir  # auto | shared | copy (workdir_sync.MODES)
        self.workdir_limit = workdir_limit  # bytes; None: $TAAS_WORKDIR_LIMIT, else 1 GiB
        self.cluster = RayCluster(address)
        self.reservation = Reservation()
        self._jobs: list[RayJob] = []
        self._planned: dict[int, tuple] = {}  # world -> rank_nodes topology() planned with
        self._last_plan: placement.Plan | None = None  # the plan topology() returned last

    # -- the cluster --------------------------------------------------------------------
    def connect(self):
        return self.cluster.connect()

    def nodes(self) -> list[placement.Node]:
        return self.cluster.nodes()

    # Test harnesses (tests/support/ray_driver.py, tests/cluster/test_cluster_kernel.py) read
    # the agents' descriptions (their pids) through these two names.
    def _describe(self, nodes: list[placement.Node]) -> dict[str, dict]:
        return self.cluster.info(nodes)

    @property
    def _info(self) -> dict[str, dict]:
        return self.cluster.described()

    def cuda_devices(self) -> int:
        gpu_nodes = [n for n in self.nodes() if int(n.gpus) >= 1]
        if not gpu_nodes:
            return 0
        info = self.cluster.info(gpu_nodes)
        seen = [min(int(n.gpus), info[n.node_id]["cuda"]) for n in gpu_nodes]
        # Ranks see CUDA everywhere, or the whole job runs gloo on CPU (one device per job).
        return sum(seen) if all(seen) else 0

    def describe(self) -> list[str]:
        nodes = sorted(self.nodes(), key=lambda n: placement.ip_key(n.ip))
        cuda = self.cuda_devices()
        lines = [f"taas: Ray cluster at {self.address}: {placement.describe(nodes)}; "
                 + ("NCCL ranks, one GPU each" if cuda else
                    "ranks see no CUDA device: they run on CPU with gloo, one per GPU slot"
                    if any(int(n.gpus) for n in nodes) else "no GPU: ranks run on CPU with gloo")]
        for n in nodes:
            lines.append(f"  node {n.ip:<15} {int(n.gpus)} GPU(s) {int(n.cpus):>3} CPU(s)  {n.node_id[:12]}")
        lines.append("  working directory: " + self._workdir_rule())
        return lines

    def _workdir_rule(self) -> str:
        from taas.workdir import sync as workdir_sync

        try:
            limit = workdir_sync.human(self.workdir_limit if self.workdir_limit is not None
                                       else workdir_sync.limit_from_env())
        except LaunchError as exc:
            limit = str(exc)
        return {"shared": "shared by every node (--workdir shared)",
                "copy": f"copied to every node, up to {limit} (--workdir copy)",
                }.get(self.workdir, f"used where a node sees it, else copied there, up to {limit} "
                                    "(--workdir auto)")

    def check(self, processes: int, device: str = "cpu", ranks: int | None = None) -> None:
        ranks = processes if ranks is None else ranks
        placement.plan(self.nodes(), ranks, processes - ranks)

    def topology(self, world: int) -> Topology:
        """Ranks packed onto GPU nodes as :meth:`start` will place them (planned here for
        ``world`` ranks: the session asks before :meth:`start`); the kernel's address is where
        the nodes reach it.  Never the kernel's machine: the session picks the TCP transport
        (its hub on that address, one relay per GPU node, given ``TAAS_DATA_HOST`` by the
        agent there)."""
        ray = self.connect()
        plan = placement.plan(self.nodes(), max(world, 1))
        self._planned[world] = plan.rank_nodes
        self._last_plan = plan
        return Topology(rank_nodes=tuple(place.group_rank for place in plan.places),
                        node_ids=tuple(node.node_id for node in plan.nodes),
                        host=self._kernel_ip(ray), kernel_machine=False)

    def _kernel_ip(self, ray) -> str:
        """The address this kernel is reached at from the cluster's nodes (the data hub
        listens there).  A kernel that is a Ray driver has its node's address.  Through Ray
        Client (``ray://``) it is on no Ray node, and Ray's own guess is the interface towards
        the internet (or the hostname's address where there is no route), which need not face
        the cluster: the interface this machine uses towards the head's client server does."""
        server = _client_server(ray, self.address)
        if server is None:
            return ray.util.get_node_ip_address()
        try:
            with socket.socket(socket.AF_INET6 if ":" in server[0] else socket.AF_INET,
                               socket.SOCK_DGRAM) as probe:
                probe.connect(server)  # UDP: nothing is sent, the kernel only picks the route
                return probe.getsockname()[0]
        except OSError:  # no route from here (cannot be, we are connected): Ray's guess
            return ray.util.get_node_ip_address()

    # -- jobs ---------------------------------------------------------------------------
    def start(self, spec: LaunchSpec) -> RayJob:
        nodes = {n.node_id: n for n in self.nodes()}
        ranks = [p for p in spec.processes if p.rank is not None]
        workers = [p for p in spec.processes if p.role == keys.LOADER]
        plan = placement.plan(list(nodes.values()), len(ranks), len(workers))
        relays = len(workers) + len(ranks) < len(spec.processes)
        if relays and not ranks:
            plan = self._beside_ranks(plan, list(nodes.values()))
        elif relays and plan.rank_nodes != self._planned.get(len(ranks)):
            # The transport was made for another placement: its relays would serve the wrong ranks.
            raise LaunchError(CHANGED)
        if spec.device == "cuda":
            info = self.cluster.info([nodes[i] for i in set(plan.rank_nodes)])
            for node_id in set(plan.rank_nodes):
                need, seen = plan.rank_nodes.count(node_id), info[node_id]["cuda"]
                if seen < need:
                    raise LaunchError(f"node {nodes[node_id].ip} runs {need} CUDA rank(s) but its "
                                      f"processes see {seen} CUDA device(s)")
        job = RayJob(self.cluster, self.reservation, spec, Workdir(self.workdir, self.workdir_limit))
        try:
            job.launch(plan, nodes)
        except (LaunchError, KeyboardInterrupt):  # leave nothing behind
            job.close()
            raise
        except Exception as exc:  # broad: any Ray error (a dead agent, a lost node) ends the same way
            job.close()
            for node_id in job.node_ids:  # a dead agent is started afresh next time
                self.cluster.forget(node_id)
            raise LaunchError(f"could not start the job on the cluster: {message(exc)}") from None
        self._jobs = [j for j in self._jobs if not j.closed] + [job]
        return job

    def _beside_ranks(self, plan: placement.Plan, nodes: list[placement.Node]) -> placement.Plan:
        """A kept cell's loader job (taas.supervisor.celldata): loader workers and relays, no
        rank.  Its relays serve the kept ranks, which the transport's topology placed: they go
        to that plan's GPU nodes (``ProcessSpec.node`` numbers them), the workers where
        ``plan`` puts them; refused if the cluster's nodes changed since."""
        planned = self._last_plan
        if planned is None or placement.plan(nodes, len(planned.rank_nodes)).rank_nodes != planned.rank_nodes:
            raise LaunchError(CHANGED)
        return dataclasses.replace(plan, nodes=planned.nodes)

    def shutdown(self) -> None:
        """End every job and agent (their processes die with them); disconnect if we connected."""
        for job in self._jobs:
            job.close()
        self._jobs = []
        if not self.cluster.connected:
            return
        self.reservation.release()
        self.cluster.shutdown()


def _client_server(ray, address: str) -> tuple[str, int] | None:
    """(host, port) of the Ray Client server this kernel is connected through, None when it
    is a Ray driver itself."""
    client = getattr(getattr(ray.util, "client", None), "ray", None)
    if client is None or not client.is_connected():
        return None
    if not address.startswith("ray://"):  # the user connected: ask the client what to
        worker = getattr(client.get_context(), "client_worker", None)
        address = "ray://" + str(getattr(worker, "_conn_str", ""))  # private: may be missing
    try:
        url = urlsplit(address)
        return (url.hostname, url.port or 10001) if url.hostname else None
    except ValueError:  # a malformed address cannot have connected; nothing to go by
        return None
