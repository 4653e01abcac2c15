"""The Ray launcher: a job's processes on the nodes of a Ray cluster the user already runs.

    kernel ── RayLauncher ──ray.init(address, log_to_driver=False)──> cluster
                 │  placement.plan(nodes, ranks, workers)      pure: which node, GROUP_RANK...
                 │  placement group: {"GPU": 1} per rank, pinned to the planned nodes
                 │  node 0's agent: host_store(world) -> (ip, port)      (MASTER_ADDR/PORT)
                 ▼  per node: agent.start(its ProcessSpecs, env already placed)
             NodeAgent × nodes (taas.launch.ray.agent: a LocalLauncher each, warm)
                 │  fork from the node's warm start process; pipes to the agent
                 ▼
             ranks, loader workers  ──output──> agent ──events() long poll──> RayJob.events

taas never starts a Ray cluster: ``address`` is what ``ray.init(address=...)`` takes of a
running one (``"auto"``, ``"10.0.0.1:6379"``, ``"ray://HOST:10001"``).  Through Ray Client
(``ray://``) the kernel is no Ray driver: the head's client server runs one for it (a proxy),
which owns the agents; the data hub then listens on the kernel's address towards that server.  If the kernel is already
connected (the user called ``ray.init``), that connection is used as it is.  Ray's own log
forwarding is off for a connection taas makes: output travels through the agents, whole and in
order, to the kernel's output router.

Agents are actors owned by the kernel's connection (not detached): they stay warm between
cells and die with it -- and their start processes, ranks and loader workers with them.  An
agent (or node) that dies becomes an exit (-9) of each of its processes; the supervisor stops
the rest at the first failure, and a restart starts a fresh attempt wherever the plan says.

The notebook's working directory: a node that sees it (project storage mounted everywhere, a
simulated cluster) starts its processes there, and the kernel reads the ``--storage layer``
uppers of its ranks from the paths its agent reports.  A node that does not gets a copy, kept
per kernel on the node and updated before each job; after the job, what its processes allowed
to write the directory changed comes back, and its layers travel to the kernel to be merged
(:mod:`taas.workdir.sync`).  ``workdir`` says which nodes are which: ``"auto"`` (the
kernel writes a marker file in the directory and asks each agent whether it sees it, once per
node and directory), ``"shared"`` or ``"copy"`` (every node).
Registered loaders' units travel over TCP (the session picks TCP from :meth:`RayLauncher.topology`): loader workers
on the CPU nodes, a relay on each GPU node of the job filling its ranks' shared memory.  The
kernel's resident big tensors travel through
the object store, copied once per node.
"""

from __future__ import annotations

import logging
import os
import threading

from taas.errors import LaunchError
from taas.launch.ray import placement
from taas.io import keys
from taas.launch.api import LaunchSpec, Launcher, Topology
from taas.launch.ray.job import _CALL_TIMEOUT, RayJob, _message
from taas.shield import import_shielded

log = logging.getLogger(__name__)

RELAY = "data-relay:"  # a data transport's process for GPU node <n> of the plan: placed there

_PG_TIMEOUT = 30.0  # waiting for the cluster to reserve the job's GPUs
# The placement group is given back when its job ends: GPUs held between cells would block
# other users' jobs (and other kernels) on a shared cluster.  The price: GPUs a removed group
# held return to the cluster only at its next resource report (~1 s measured), so a cell run
# right after the previous one may wait that long for its reservation.


def _ray():
    import_shielded("ray")  # an interrupt must not leave Ray half-imported (taas.shield)
    import ray

    return ray


def _connect_error(address: str, exc: BaseException) -> str:
    """One line for a failed ``ray.init(address)``.  A refused token (Ray wraps its
    AuthenticationError in a ConnectionError that only says "Failed to connect") says what the
    user sets; taas itself never reads, writes or passes on a token: Ray does, from the
    environment, as for any other Ray client."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e)
           or "authentication token" in str(e).lower() for e in chain):
        return (f"the Ray cluster at {address!r} refused this kernel's authentication token: it uses "
                "token authentication; start the kernel with RAY_AUTH_MODE=token and the cluster's "
                "token in RAY_AUTH_TOKEN_PATH (a file only you can read) or ~/.ray/auth_token")
    if address.startswith("ray://") and any("ray client connection timeout" in str(e) for e in chain):
        # Ray Client retries a refused token (gRPC UNAUTHENTICATED) as it retries an unreachable
        # server, and ends both with this timeout: say both.
        return (f"cannot connect to the Ray cluster at {address!r}: its Ray Client server did not "
                "answer (is the head's client port, 10001 by default, reachable from here? on a "
                "cluster with token authentication, start the kernel with RAY_AUTH_MODE=token and "
                "the cluster's token); from a machine in the cluster's network, the GCS address "
                "HOST:6379 connects directly")
    return f"cannot connect to the Ray cluster at {address!r}: {_message(exc)}"


def kernel_gone() -> bool | None:
    """In an agent: whether the kernel that owns it (its Ray job's driver) has ended, as the
    GCS records it: at once when the driver's connection to its raylet closes (a killed
    kernel), or when its node is declared dead.  Through Ray Client the driver is the client
    server's proxy for the kernel, which outlives a killed kernel by the client's reconnect
    grace period (``RAY_CLIENT_RECONNECT_GRACE_PERIOD`` in the kernel, 30 s by default): a
    kernel that might reconnect is not gone, so its job runs on that long.  None when the GCS cannot be asked (a Ray
    without this internal call, or no answer in 10 s): the agent then falls back to the
    kernel's silence."""
    try:
        import ray

        job = ray.get_runtime_context().get_job_id()
        client = ray._private.worker.global_worker.gcs_client
        jobs = client.get_all_job_info(job_or_submission_id=job, skip_submission_job_info_field=True,
                                       skip_is_running_tasks_field=True, timeout=10)
        for info in jobs.values():
            if info.job_id.hex() == job:
                return bool(info.is_dead)
        return None
    except Exception:  # broad: internal API; whatever fails, the agent cannot tell
        return None


class RayLauncher(Launcher):
    where = "the cluster"

    def __init__(self, address: str, workdir: str = "auto", workdir_limit: int | None = None):
        self.address = address
        self.workdir = workdir  # auto | shared | copy (workdir_sync.MODES)
        self.workdir_limit = workdir_limit  # bytes; None: $TAAS_WORKDIR_LIMIT, else 1 GiB
        self._sees: dict[tuple[str, str], bool] = {}  # (node id, cwd) -> the node sees cwd
        self._connected = False
        self._ours = False  # we called ray.init: ray.shutdown() is ours to call too
        self._agents: dict[str, object] = {}  # node id -> actor handle
        self._info: dict[str, dict] = {}  # node id -> the agent's describe()
        self._jobs: list[RayJob] = []
        self._pg = None  # the GPUs reserved for the current (or last) job's shape
        self._pg_bundles: list | None = None
        self._pg_lock = threading.Lock()
        self._planned: dict[int, tuple] = {}  # world -> rank_nodes topology() planned with

    # -- the cluster --------------------------------------------------------------------
    def connect(self):
        ray = _ray()
        if not self._connected:
            if not ray.is_initialized():
                try:
                    ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
                except Exception as exc:  # broad: Ray raises ConnectionError, ValueError, RuntimeError...
                    raise LaunchError(_connect_error(self.address, exc)) from None
                self._ours = True
            self._connected = True
        return ray

    def nodes(self) -> list[placement.Node]:
        ray = self.connect()
        return [placement.Node(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0),
                               n["Resources"].get("CPU", 0.0))
                for n in ray.nodes() if n.get("Alive")]

    def _agent(self, node: placement.Node):
        """The node's agent, started if it has none yet."""
        agent = self._agents.get(node.node_id)
        if agent is None:
            ray = self.connect()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from taas.launch.ray.agent import NodeAgent

            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            agent = ray.remote(NodeAgent).options(
                num_cpus=0, max_concurrency=8,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            ).remote(node.node_id, node.ip, kernel_gone)
            self._agents[node.node_id] = agent
        return agent

    def _forget(self, node_id: str) -> None:
        """Drop a node's agent that failed (dead, or not answering): killed, to be sure that a
        stuck one does not linger with its start process; the next job starts a fresh one."""
        agent = self._agents.pop(node_id, None)
        self._info.pop(node_id, None)
        self._sees = {key: seen for key, seen in self._sees.items() if key[0] != node_id}
        if agent is not None:
            try:
                _ray().kill(agent)
            except Exception:  # broad: it is gone already, whatever Ray calls that
                pass

    def _describe(self, nodes: list[placement.Node]) -> dict[str, dict]:
        """The agents' own view of their nodes (CUDA devices a rank there sees)."""
        ray = self.connect()
        missing = [n for n in nodes if n.node_id not in self._info]
        refs = [self._agent(n).describe.remote() for n in missing]
        for node, ref in zip(missing, refs):
            try:
                self._info[node.node_id] = ray.get(ref, timeout=_CALL_TIMEOUT)
            except Exception as exc:  # broad: any Ray error means this node has no agent now
                self._forget(node.node_id)
                raise LaunchError(f"taas could not start its agent on node {node.ip}: {_message(exc)}") from None
        return {n.node_id: self._info[n.node_id] for n in nodes}

    def copy_nodes(self, node_ids, cwd: str) -> set[str]:
        """Which of ``node_ids`` (their agents started) get a copy of ``cwd``."""
        if self.workdir == "shared":
            return set()
        if self.workdir == "copy":
            return set(node_ids)
        unknown = [n for n in node_ids if (n, cwd) not in self._sees]
        if unknown:
            import secrets
            import tempfile

            content = secrets.token_bytes(16)
            try:
                fd, marker = tempfile.mkstemp(dir=cwd, prefix=".taas-where-")
            except OSError:  # the kernel cannot write there: nothing would come back anyway
                return set()
            try:
                try:
                    os.write(fd, content)
                finally:
                    os.close(fd)
                ray = self.connect()
                refs = {n: self._agents[n].sees.remote(marker, content) for n in unknown}
                for node_id, ref in refs.items():
                    self._sees[(node_id, cwd)] = bool(ray.get(ref, timeout=_CALL_TIMEOUT))
            finally:
                os.unlink(marker)
        return {n for n in node_ids if not self._sees[(n, cwd)]}

    def cuda_devices(self) -> int:
        gpu_nodes = [n for n in self.nodes() if int(n.gpus) >= 1]
        if not gpu_nodes:
            return 0
        info = self._describe(gpu_nodes)
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
        import socket

        try:
            with socket.socket(socket.AF_INET6 if ":" in server[0] else socket.AF_INET,
                               socket.SOCK_DGRAM) as probe:
                probe.connect(server)  # UDP: nothing is sent, the kernel only picks the route
                return probe.getsockname()[0]
        except OSError:  # no route from here (cannot be, we are connected): Ray's guess
            return ray.util.get_node_ip_address()

    # -- jobs ---------------------------------------------------------------------------
    def start(self, spec: LaunchSpec) -> "RayJob":
        ray = self.connect()
        nodes = {n.node_id: n for n in self.nodes()}
        ranks = [p for p in spec.processes if p.rank is not None]
        workers = [p for p in spec.processes if p.role == keys.LOADER]
        plan = placement.plan(list(nodes.values()), len(ranks), len(workers))
        if len(workers) + len(ranks) < len(spec.processes) and plan.rank_nodes != self._planned.get(len(ranks)):
            # The transport was made for another placement: its relays would serve the wrong ranks.
            raise LaunchError("the cluster's nodes changed while the job was prepared; run the cell again")
        if spec.device == "cuda":
            info = self._describe([nodes[i] for i in set(plan.rank_nodes)])
            for node_id in set(plan.rank_nodes):
                need, seen = plan.rank_nodes.count(node_id), info[node_id]["cuda"]
                if seen < need:
                    raise LaunchError(f"node {nodes[node_id].ip} runs {need} CUDA rank(s) but its "
                                      f"processes see {seen} CUDA device(s)")
        attempt = spec.attempt
        job = RayJob(self, ray, spec, attempt)
        try:
            job._launch(plan, nodes)
        except (LaunchError, KeyboardInterrupt):  # leave nothing behind
            job.close()
            raise
        except Exception as exc:  # broad: any Ray error (a dead agent, a lost node) ends the same way
            job.close()
            for node_id in job._agents:  # a dead agent is started afresh next time
                self._forget(node_id)
            raise LaunchError(f"could not start the job on the cluster: {_message(exc)}") from None
        self._jobs = [j for j in self._jobs if not j.closed] + [job]
        return job

    # -- the GPU reservation ------------------------------------------------------------
    def _reserve(self, bundles: list[dict], attempt: str) -> None:
        """Reserve ``bundles`` (a placement group), reusing one still held when it is the same."""
        from ray.util.placement_group import placement_group

        with self._pg_lock:
            if self._pg is not None and self._pg_bundles == bundles:
                return
            self._release_locked()
            pg = placement_group(bundles, strategy="PACK", name=f"taas-{attempt}")
            if not pg.wait(_PG_TIMEOUT):
                _remove_pg(pg)
                raise LaunchError(f"the cluster did not reserve {len(bundles)} GPU(s) in "
                                  f"{_PG_TIMEOUT:.0f} s: other work holds them; try again, or use fewer --gpus")
            self._pg, self._pg_bundles = pg, bundles

    def _job_ended(self) -> None:
        """Give the GPUs back as soon as no job of ours runs."""
        self._release()

    def _release(self) -> None:
        with self._pg_lock:
            if not any(not job.closed for job in self._jobs):
                self._release_locked()

    def _release_locked(self) -> None:
        if self._pg is not None:
            _remove_pg(self._pg)
        self._pg, self._pg_bundles = None, None

    def shutdown(self) -> None:
        """End every job and agent (their processes die with them); disconnect if we connected."""
        for job in self._jobs:
            job.close()
        self._jobs = []
        if not self._connected:
            return
        with self._pg_lock:
            self._release_locked()
        ray = _ray()
        refs = [agent.shutdown.remote() for agent in self._agents.values()]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        except Exception:  # broad: a dead agent or connection needs no shutdown
            pass
        for agent in self._agents.values():
            try:
                ray.kill(agent)
            except Exception:  # broad: already gone
                pass
        self._agents.clear()
        self._info.clear()
        if self._ours:
            ray.shutdown()
        self._connected = self._ours = False


def _client_server(ray, address: str) -> tuple[str, int] | None:
    """(host, port) of the Ray Client server this kernel is connected through, None when it
    is a Ray driver itself."""
    from urllib.parse import urlsplit

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


def _remove_pg(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # broad: the cluster freed it already (the driver is leaving)
        pass
