"""One attempt of a job on a Ray cluster: the handle over its nodes' agents.

:class:`RayJob` merges the agents' event streams -- one long-poll ``events()`` call outstanding
per agent, ``ray.wait`` over them -- and routes ``stop``, ``fetch``, ``request_stacks`` and
``layers`` to the agents of the processes' nodes.  An agent whose call fails (its process or
its node died) becomes a :class:`~taas.launch.api.ProcessExit` of -9 for each of its processes
that had not exited: they died with it.  Their failure reports (``fetch``) then say so, naming
the node: the node holds no report of its own any more, and "killed by SIGKILL" alone would not
tell the user that a whole machine's share of the job went.

Nodes that do not share the notebook's working directory (``RayCluster.copy_nodes``) get it
copied before the attempt starts, and once its processes are stopped what the writers there
changed comes back (:mod:`taas.launch.ray.copies`).

The job talks to the rest of the launcher through public calls only: the cluster's agent pool
(:class:`~taas.launch.ray.cluster.RayCluster`: ``agent``, ``forget``, ``copy_nodes``) and the
GPU reservation (:class:`~taas.launch.ray.reservation.Reservation`: ``hold`` at launch,
``let_go`` as soon as every rank has exited, or at close), both given to its constructor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import defaultdict

from taas.errors import LaunchError
from taas.io import keys
from taas.launch import rendezvous
from taas.launch.api import (
    Event,
    JobHandle,
    LaunchSpec,
    ProcessExit,
    ProcessSpec,
    error_name,
)
from taas.launch.ray import placement, reservation
from taas.launch.ray.cluster import CALL_TIMEOUT, RayCluster, message
from taas.launch.ray.copies import WorkdirCopies
from taas.launch.ray.kept import KeptCalls
from taas.launch.ray.reservation import Reservation

log = logging.getLogger(__name__)

_LONG_POLL = 1.0  # seconds an agent's events() call waits for something to report


@dataclasses.dataclass(frozen=True)
class Workdir:
    """How the notebook's working directory reaches the nodes: ``mode`` (auto, shared, copy:
    :data:`taas.workdir.sync.MODES`) and ``limit`` (bytes a copy may take; None:
    ``$TAAS_WORKDIR_LIMIT``, else 1 GiB)."""

    mode: str = "auto"
    limit: int | None = None


class RayJob(KeptCalls, JobHandle):
    """An attempt spread over agents: their events merged, stop/fetch/stacks routed by node.

    It uses the cluster's agent pool (``cluster``: :meth:`RayCluster.agent`,
    :meth:`~RayCluster.forget` the agent of a node that failed, :meth:`~RayCluster.copy_nodes`)
    and holds the GPU ``reservation`` from :meth:`launch` until :meth:`close`.  Its
    kept-ranks calls (``--keep``) come from :class:`~taas.launch.ray.kept.KeptCalls`."""

    def __init__(self, cluster: RayCluster, reservation: Reservation, spec: LaunchSpec,
                 workdir: Workdir = Workdir()):
        self._cluster = cluster
        self._reservation = reservation
        self._ray = cluster.connect()
        self._spec = spec
        self._workdir = workdir
        self._attempt = spec.attempt
        self._keys = [p.key for p in spec.processes]
        self._node_of: dict[str, str] = {}
        self._ip_of: dict[str, str] = {}  # node id -> its address, for messages
        self._lost: dict[str, float] = {}  # node id -> when its agent was found dead
        self._agents: dict[str, object] = {}  # node id -> agent, for this attempt's nodes
        self._pids: dict[str, int] = {}
        self._polls: dict[object, str] = {}  # outstanding events() call -> node id
        self._finished: set[str] = set()
        self._exited: set[str] = set()
        self._pending: list[Event] = []
        self._store_node: str | None = None
        self._copies = WorkdirCopies(self._ray, spec.cwd, self._attempt, workdir.limit)
        self._ranks = {p.key for p in spec.processes if p.rank is not None}
        self._let_go = False  # the GPU reservation given back (every rank exited, or closed)
        self._reserving = False  # the job reserved GPUs (its plan places ranks by GPU)
        self._stopped = False
        self.closed = False

    @property
    def node_ids(self) -> list[str]:
        """The nodes whose agents this attempt uses."""
        return list(self._agents)

    def launch(self, plan: placement.Plan, nodes: dict[str, placement.Node]) -> None:
        """Start the attempt where ``plan`` says (``nodes``: the cluster's, by id): reserve the
        GPUs, start or reuse the nodes' agents, copy the working directory where a node needs
        it, host the rendezvous store on the plan's node 0, and start each node's share."""
        spec = self._spec
        if plan.by == "GPU" and plan.rank_nodes:  # reserve the GPUs where the plan puts the ranks
            self._reserving = True
            self._reservation.hold(reservation.bundles([nodes[n].ip for n in plan.rank_nodes]),
                                   self._attempt)
        relay_nodes = tuple(plan.nodes[p.node].node_id for p in spec.processes
                            if p.rank is None and p.node is not None)
        for node_id in dict.fromkeys(plan.rank_nodes + plan.worker_nodes + relay_nodes):
            self._agents[node_id] = self._cluster.agent(nodes[node_id])
            self._ip_of[node_id] = nodes[node_id].ip
        copies = self._cluster.copy_nodes(list(self._agents), spec.cwd, self._workdir.mode)
        if copies:
            self._copies.ship({n: self._agents[n] for n in sorted(copies)}, self._ip_of)
        master, port = "", 0
        if spec.world_size:
            self._store_node = plan.nodes[0].node_id
            master, port = self._get(self._agents[self._store_node].host_store.remote(
                self._attempt, spec.world_size))
        per_node = self._place(plan, nodes, master, port)
        self._start_shares(per_node, nodes)

    def _place(self, plan: placement.Plan, nodes: dict[str, placement.Node], master: str,
               port: int) -> dict[str, list[ProcessSpec]]:
        """Each node's processes of the attempt: ranks where the plan puts them (with torchrun's
        environment for the store at ``master:port``), a transport's relay on the plan's node
        it names, loader workers round the plan's worker nodes."""
        spec = self._spec
        ranks = iter(zip(plan.rank_nodes, plan.places))
        workers = iter(plan.worker_nodes)
        per_node: dict[str, list[ProcessSpec]] = defaultdict(list)
        for proc in spec.processes:
            if proc.rank is not None:
                node_id, place = next(ranks)
                assert place.rank == proc.rank, "the supervisor numbers ranks 0..N-1 in order"
                env = dict(proc.env, **rendezvous.torchrun_env(place, spec.world_size, master, port,
                                                                spec.job_id, spec.restart,
                                                                spec.max_restarts),
                           NODE_RANK=str(place.group_rank))  # Lightning's name for GROUP_RANK
                proc = dataclasses.replace(proc, env=env)
            elif proc.node is not None:  # the data transport's relay for GPU node <g>
                node_id = plan.nodes[proc.node].node_id
                self._ip_of.setdefault(node_id, nodes[node_id].ip)
            else:
                node_id = next(workers)
            per_node[node_id].append(proc)
            self._node_of[proc.key] = node_id
        return per_node

    def _start_shares(self, per_node: dict[str, list[ProcessSpec]],
                      nodes: dict[str, placement.Node]) -> None:
        """Hand each node's share to its agent, all at once, and wait for every agent's answer
        (raises LaunchError naming each node that failed)."""
        ray, spec = self._ray, self._spec
        files = ray.put(spec.files)
        shared = [ray.put(_read_fd(fd)) for fd in spec.shared_fds]
        calls = {}
        for node_id, procs in per_node.items():
            cwd = self._copies.cwd_of(node_id)  # the node's copy, where it has one
            sub = LaunchSpec(spec.job_id, cwd, tuple(procs), {}, (), spec.device, spec.restart,
                             spec.max_restarts, spec.cleanups, placed=True)
            calls[node_id] = self._agents[node_id].start.remote(sub, files, *shared)
        errors = []
        starting = {ref: node_id for node_id, ref in calls.items()}
        deadline = time.monotonic() + CALL_TIMEOUT
        while starting:
            # A node that started is polled at once and again while others still start (a
            # fresh agent's start process may still be importing torch): its output streams
            # from the start, and an agent that cannot ask the cluster whether the kernel
            # lives (NodeAgent._watch_kernel) does not wait long for a sign of it.
            wait = min(_LONG_POLL / 2, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(starting), num_returns=1, timeout=wait)
            for ref in ready:
                node_id = starting.pop(ref)
                try:
                    self._pids.update(ray.get(ref))
                    self._poll(node_id)
                except Exception as exc:  # broad: a LaunchError in the agent or any Ray error
                    errors.append(f"node {nodes[node_id].ip}: {message(exc)}")
                    if not isinstance(getattr(exc, "cause", None), LaunchError):
                        self._cluster.forget(node_id)  # the agent itself failed: a fresh one next time
            if self._polls:
                self._wait(0)  # events that came meanwhile are kept in order for events()
            if starting and time.monotonic() >= deadline:
                for node_id in starting.values():
                    errors.append(f"node {nodes[node_id].ip}: its agent did not answer in {CALL_TIMEOUT:.0f} s")
                    self._cluster.forget(node_id)
                break
        if errors:
            raise LaunchError("could not start the job: " + "; ".join(errors))

    def _bring_back(self) -> None:
        """What the attempt's processes changed in the nodes' copies, into the working
        directory (:meth:`WorkdirCopies.bring_back`): once they are gone."""
        writers = {self._node_of[p.key] for p in self._spec.processes
                   if p.storage == "shared" and p.key in self._node_of}
        self._copies.bring_back(self._agents, writers, self._node_of.get(keys.rank_key(0)))

    def _get(self, ref, timeout: float = CALL_TIMEOUT):
        return self._ray.get(ref, timeout=timeout)

    def _poll(self, node_id: str) -> None:
        self._polls[self._agents[node_id].events.remote(_LONG_POLL, self._attempt)] = node_id

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def events(self, timeout: float):
        if not self._pending and self._polls:
            self._wait(timeout)
        elif not self._pending:
            time.sleep(timeout)  # nothing outstanding: wait as the contract says, never spin
        out, self._pending = self._pending, []
        self._let_go_when_ranks_ended()  # once the supervisor has the exits, not while launching
        return out

    def _wait(self, timeout: float) -> None:
        ray = self._ray
        ready, rest = ray.wait(list(self._polls), num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            node_id = self._polls.pop(ref)
            try:
                events, finished = ray.get(ref)
            except Exception as exc:  # broad: a dead agent or node, whatever Ray calls it
                log.debug("agent on node %s lost: %s", node_id, exc)
                self._lose(node_id)
                continue
            for event in events:
                if isinstance(event, ProcessExit):
                    self._exited.add(event.key)
            self._pending.extend(events)
            if finished:
                self._finished.add(node_id)
                self._unreported(node_id)
            else:
                self._poll(node_id)

    def _let_go_when_ranks_ended(self) -> None:
        """Give the GPUs back as soon as every rank has exited (a rank's exit is reported once
        it is reaped, with its process group killed) or :meth:`stop` has ended them: not at
        close, after the results are read, so that Ray has them back by the time a cell run
        right after this one asks (:mod:`taas.launch.ray.reservation`)."""
        if self._ranks <= self._exited:
            self._give_back()

    def _give_back(self) -> None:
        if not self._let_go:
            self._let_go = True
            self._reservation.let_go(self._attempt)

    def _unreported(self, node_id: str) -> None:
        """A node's job is over but some of its processes' exits never came (the agent ended
        the job itself, see NodeAgent's watchdog): they are gone, report them so."""
        for key, where in self._node_of.items():
            if where == node_id and key not in self._exited:
                log.debug("%s ended on node %s without an exit report", key, node_id)
                self._exited.add(key)
                self._pending.append(ProcessExit(key, self._pids.get(key, 0), -9))

    def _lose(self, node_id: str) -> None:
        """An agent (or its node) died: so did its processes (their start process's guard has
        the agent as its parent)."""
        self._finished.add(node_id)
        self._lost.setdefault(node_id, time.time())
        self._cluster.forget(node_id)
        for key, where in self._node_of.items():
            if where == node_id and key not in self._exited:
                self._exited.add(key)
                self._pending.append(ProcessExit(key, self._pids.get(key, 0), -9))

    def _each(self, call, *args, timeout: float = CALL_TIMEOUT) -> dict[str, object]:
        """Call every agent of the attempt at once; node id -> answer (dead agents left out)."""
        refs = {node_id: getattr(agent, call).remote(*args) for node_id, agent in self._agents.items()}
        out = {}
        for node_id, ref in refs.items():
            try:
                out[node_id] = self._get(ref, timeout)
            except Exception:  # broad: a dead agent has nothing to give and nothing to stop
                pass
        return out

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped or not self._agents:
            return
        stopped = self._each("stop", grace, self._attempt, timeout=grace + 15)
        self._stopped = True
        # An agent's stop returns once every process of its node's share is reaped: the ranks'
        # GPUs are free now, before their exits are read (see _let_go_when_ranks_ended).
        if {self._node_of[key] for key in self._ranks if key in self._node_of} <= set(stopped):
            self._give_back()
        self._bring_back()

    def drain(self, timeout: float = 2.0) -> list[Event]:
        out: list[Event] = []
        deadline = time.monotonic() + timeout
        while self._polls and time.monotonic() < deadline:
            out.extend(self.events(0.05))
        return out + self.events(0)

    def fetch(self, key: str, name: str) -> bytes | None:
        node_id = self._node_of.get(key, "")
        if node_id in self._lost:
            return self._lost_report(key, node_id) if name == error_name(key) else None
        agent = self._agents.get(node_id)
        if agent is None:
            return None
        try:
            return self._get(agent.fetch.remote(key, name))
        except Exception:  # broad: the node is gone, and what it held with it
            return None

    def _lost_report(self, key: str, node_id: str) -> bytes:
        """The failure report of a process that went with its node's agent (as
        :mod:`taas.launch.process.report` writes one): the time the agent was found dead."""
        ip = self._ip_of.get(node_id, node_id[:12])
        return json.dumps({
            "key": key, "time": self._lost[node_id], "exit_code": -9, "chain": [], "hint": None,
            "message": f"was lost with node {ip}: taas's agent there died (its process or the node was killed)",
        }).encode()

    def request_stacks(self, keys) -> list[str]:
        by_node: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            if key in self._node_of:
                by_node[self._node_of[key]].append(key)
        refs = [self._agents[n].request_stacks.remote(k) for n, k in by_node.items()]
        asked: list[str] = []
        for ref in refs:
            try:
                asked += self._get(ref, 10)
            except Exception:  # broad: a dead agent's ranks cannot answer
                pass
        return asked

    def answer(self, key: str, reply) -> bool:
        agent = self._agents.get(self._node_of.get(key, ""))
        if agent is None:
            return False
        try:
            return bool(self._get(agent.answer.remote(key, reply), 10))
        except Exception:  # broad: a dead agent's rank cannot read it
            return False

    def layers(self) -> list[tuple[str, str]]:
        """The layers' uppers: as their agents report them where the node shares the working
        directory, else fetched from the node into a directory of the kernel's (removed at
        :meth:`close`)."""
        self._bring_back()
        out = [layer for node_id, found in self._each("layers", self._attempt).items() if node_id not in self._copies
               for layer in found]
        if self._copies.paths:
            out += self._copies.fetch_layers(self._each("layer_entries", self._attempt))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.stop()
            self._bring_back()  # when stop() had nothing to stop
            self._each("close", self._attempt)
            if self._store_node is not None and self._store_node in self._agents:
                self._each_one(self._store_node, "close_store", self._attempt)
        finally:
            self._polls.clear()
            self._copies.remove()
            self._reservation.let_go(self._attempt)

    def _each_one(self, node_id: str, call: str, *args) -> None:
        try:
            self._get(getattr(self._agents[node_id], call).remote(*args))
        except Exception:  # broad: a dead agent holds nothing any more
            pass


def _read_fd(fd: int) -> bytes:
    """The whole content of one of the kernel's shared files (a resident big tensor)."""
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
