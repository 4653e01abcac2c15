"""The kernel's connection to a Ray cluster and its pool of node agents.

:class:`RayCluster` is what the launcher and its jobs know of the cluster: :meth:`connect`
(``ray.init`` once, unless the user connected already), the live :meth:`nodes`, and one
:class:`~taas.launch.ray.agent.NodeAgent` actor per node (:meth:`agent`), started on first use
and kept warm between cells.  An agent whose call failed is :meth:`forget`-ten (killed, so that
a stuck one does not linger with its start process); the next job starts a fresh one.  What the
agents said of their nodes (:meth:`info`: the CUDA devices a rank there sees) and whether a
node sees the kernel's working directory (:meth:`copy_nodes`) are asked once per agent and go
with it.

Agents are actors owned by the kernel's connection (not detached): they die with it, and their
start processes, ranks and loader workers with them.  Ray's own log forwarding is off for a
connection taas makes: output travels through the agents, whole and in order.
"""

from __future__ import annotations

import logging
import os

from taas.errors import LaunchError
from taas.launch.ray import placement
from taas.shield import import_shielded

log = logging.getLogger(__name__)

CALL_TIMEOUT = 120.0  # an agent call that should be quick (a cold agent imports torch)


def ray_module():
    """The ``ray`` module, imported so that an interrupt cannot leave it half-imported."""
    import_shielded("ray")  # taas.shield
    import ray

    return ray


def message(exc: BaseException) -> str:
    """The first line of what went wrong in an agent (a RayTaskError carries the cause)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__


def connect_error(address: str, exc: BaseException) -> str:
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
    return f"cannot connect to the Ray cluster at {address!r}: {message(exc)}"


def kernel_gone() -> bool | None:
    """In an agent: whether the kernel that owns it (its Ray job's driver) has ended, as the
    GCS records it: at once when the driver's connection to its raylet closes (a killed
    kernel), or when its node is declared dead.  Through Ray Client the driver is the client
    server's proxy for the kernel, which outlives a killed kernel by the client's reconnect
    grace period (``RAY_CLIENT_RECONNECT_GRACE_PERIOD`` in the kernel, 30 s by default): a
    kernel that might reconnect is not gone, so its job runs on that long.  None when the GCS
    cannot be asked (a Ray without this internal call, or no answer in 10 s): the agent then
    falls back to the kernel's silence."""
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


def owned_by_host() -> bool:
    """In an agent of a detached job's host (a Ray actor, taas.host.ray): never gone by the
    kernel's Ray job, which ended with the kernel long before.  The agent is the host actor's:
    Ray ends it, and the node's processes with it (node_watch), when that actor dies."""
    return False


def _taas_root() -> str:
    """The directory taas is imported from here: agents import it from there too."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class RayCluster:
    """One Ray connection and its node agents (one per node, started on first use)."""

    def __init__(self, address: str):
        self.address = address
        self.connected = False
        self._ours = False  # we called ray.init: ray.shutdown() is ours to call too
        self._agents: dict[str, object] = {}  # node id -> actor handle
        self._info: dict[str, dict] = {}  # node id -> the agent's describe()
        self._sees: dict[tuple[str, str], bool] = {}  # (node id, cwd) -> the node sees cwd
        # What tells an agent that whoever owns it is gone: the kernel (its Ray job ended), or,
        # for a detached job's host actor, nothing but Ray ending the owner (owned_by_host).
        self.owner_gone = kernel_gone

    def connect(self):
        """The ``ray`` module, connected to the cluster (at most one ``ray.init``)."""
        ray = ray_module()
        if not self.connected:
            if not ray.is_initialized():
                try:
                    ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
                except Exception as exc:  # broad: Ray raises ConnectionError, ValueError, RuntimeError...
                    raise LaunchError(connect_error(self.address, exc)) from None
                self._ours = True
            self.connected = True
        return ray

    def nodes(self) -> list[placement.Node]:
        """The cluster's live nodes, as Ray counts their resources."""
        ray = self.connect()
        return [placement.Node(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0),
                               n["Resources"].get("CPU", 0.0))
                for n in ray.nodes() if n.get("Alive")]

    # -- the agents -------------------------------------------------------------------------
    def agent(self, node: placement.Node):
        """The node's agent (an actor handle), started if it has none yet."""
        agent = self._agents.get(node.node_id)
        if agent is None:
            ray = self.connect()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from taas.launch.ray.agent import NodeAgent

            path = os.pathsep.join(filter(None, [_taas_root(), os.environ.get("PYTHONPATH")]))
            agent = ray.remote(NodeAgent).options(
                num_cpus=0, max_concurrency=8,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            ).remote(node.node_id, node.ip, self.owner_gone)
            self._agents[node.node_id] = agent
        return agent

    def forget(self, node_id: str) -> None:
        """Drop a node's agent that failed (dead, or not answering): killed, to be sure that a
        stuck one does not linger with its start process; the next job starts a fresh one."""
        agent = self._agents.pop(node_id, None)
        self._info.pop(node_id, None)
        self._sees = {key: seen for key, seen in self._sees.items() if key[0] != node_id}
        if agent is not None:
            try:
                ray_module().kill(agent)
            except Exception:  # broad: it is gone already, whatever Ray calls that
                pass

    def info(self, nodes: list[placement.Node]) -> dict[str, dict]:
        """The agents' own view of ``nodes`` (:meth:`NodeAgent.describe`: the CUDA devices a
        rank there sees, the agent's pid), asked once per agent; their agents start here."""
        ray = self.connect()
        missing = [n for n in nodes if n.node_id not in self._info]
        refs = [self.agent(n).describe.remote() for n in missing]
        for node, ref in zip(missing, refs):
            try:
                self._info[node.node_id] = ray.get(ref, timeout=CALL_TIMEOUT)
            except Exception as exc:  # broad: any Ray error means this node has no agent now
                self.forget(node.node_id)
                raise LaunchError(f"taas could not start its agent on node {node.ip}: {message(exc)}") from None
        return {n.node_id: self._info[n.node_id] for n in nodes}

    def described(self) -> dict[str, dict]:
        """What :meth:`info` has asked so far: node id -> the agent's describe()."""
        return dict(self._info)

    def copy_nodes(self, node_ids: list[str], cwd: str, mode: str) -> set[str]:
        """Which of ``node_ids`` (their agents started) get a copy of the working directory
        ``cwd`` under ``mode`` (:data:`taas.workdir.sync.MODES`): ``"auto"`` asks each agent,
        once per node and directory, whether it sees a marker file the kernel writes there."""
        if mode == "shared":
            return set()
        if mode == "copy":
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
                    self._sees[(node_id, cwd)] = bool(ray.get(ref, timeout=CALL_TIMEOUT))
            finally:
                os.unlink(marker)
        return {n for n in node_ids if not self._sees[(n, cwd)]}

    def shutdown(self) -> None:
        """End every agent (their processes die with them); disconnect if we connected."""
        if not self.connected:
            return
        ray = ray_module()
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
        self.connected = self._ours = False
