"""A fake ``ray`` module for the Ray launcher's unit tests: no cluster, no actors, no Ray.

``fake_ray`` puts a :class:`FakeRay` in ``sys.modules`` as ``ray`` (with the two submodules
taas imports from: ``ray.util.scheduling_strategies``, ``ray.util.placement_group``).  Its
nodes (:meth:`FakeRay.set_nodes`) are listed as ``ray.nodes()`` lists them; ``ray.remote(NodeAgent)`` makes a
:class:`FakeAgent` per node instead of an actor.  A remote call runs at once and its
:class:`Ref` holds the answer (or the error), so ``ray.wait`` finds every call ready.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from taas.launch.api import ProcessExit
from taas.launch.ray.placement import Node


class Ref:
    """An object ref whose call already ran: its answer, or what it raised."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error


class _Method:
    def __init__(self, agent: FakeAgent, name: str):
        self._agent, self._name = agent, name

    def remote(self, *args):
        self._agent.calls.append((self._name, args))
        if self._agent.dead:
            return Ref(error=RuntimeError(f"The actor died unexpectedly on node {self._agent.ip}"))
        try:
            return Ref(getattr(self._agent, "do_" + self._name)(*args))
        except Exception as exc:  # as Ray does: the error comes with ray.get
            return Ref(error=exc)


class FakeAgent:
    """What the launcher asks of a node's agent (``agent.NAME.remote(...)`` runs ``do_NAME``),
    answered from fields a test sets."""

    def __init__(self, node_id: str, ip: str):
        self.node_id, self.ip = node_id, ip
        self.cuda = 0  # CUDA devices its processes see
        self.shares = True  # sees the kernel's working directory
        self.dead = False  # every call fails, as a dead actor's do
        self.started: list = []  # the LaunchSpecs of start()
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        if name.startswith(("_", "do_")):
            raise AttributeError(name)
        return _Method(self, name)

    def called(self, name: str) -> list[tuple]:
        return [args for call, args in self.calls if call == name]

    def do_describe(self):
        return {"node_id": self.node_id, "ip": self.ip, "cuda": self.cuda, "pid": 4242}

    def do_sees(self, path, content):
        return self.shares

    def do_host_store(self, attempt, world):
        return self.ip, 29500

    def do_start(self, spec, files, *shared):
        self.started.append(spec)
        return {p.key: 1000 + i for i, p in enumerate(spec.processes)}

    def do_events(self, timeout, attempt=None):
        """Every process of the last start exits at once, with 0."""
        procs = self.started[-1].processes if self.started else ()
        return [ProcessExit(p.key, 0, 0) for p in procs], True

    def do_stop(self, grace, attempt=None):
        return None

    def do_close(self, attempt=None):
        return None

    def do_close_store(self, attempt):
        return None

    def do_shutdown(self):
        return None

    def do_fetch(self, key, name):
        return None

    def do_layers(self, attempt=None):
        return []


class _ActorClass:
    def __init__(self, ray: FakeRay):
        self._ray = ray
        self.options_seen: dict = {}

    def options(self, **options):
        self.options_seen = options
        return self

    def remote(self, node_id, ip, kernel_gone=None):
        agent = self._ray.agent_for(node_id, ip)
        self._ray.started_agents.append(node_id)
        return agent


@dataclass
class FakeGroup:
    bundles: list
    name: str
    ready: bool = True
    removed: bool = False

    def wait(self, timeout):
        return self.ready


@dataclass
class Groups:
    """The placement groups made and removed (``ray.util.placement_group``)."""

    made: list = field(default_factory=list)
    ready: bool = True  # whether the cluster reserves a new group

    def placement_group(self, bundles, strategy="PACK", name=""):
        assert strategy == "PACK"
        group = FakeGroup(bundles, name, self.ready)
        self.made.append(group)
        return group

    def remove_placement_group(self, group):
        group.removed = True

    @property
    def held(self) -> list:
        return [g for g in self.made if not g.removed]


class FakeRay(types.ModuleType):
    """The part of the ``ray`` module taas uses."""

    def __init__(self):
        super().__init__("ray")
        self.node_list: list[dict] = []
        self.agents: dict[str, FakeAgent] = {}  # node id -> its agent (set up before use, or made)
        self.started_agents: list[str] = []
        self.killed: list[FakeAgent] = []
        self.initialized = False
        self.init_error: BaseException | None = None
        self.groups = Groups()
        self.node_ip = "10.9.9.9"  # ray.util.get_node_ip_address()
        self.client = types.SimpleNamespace(is_connected=lambda: False)
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: self.node_ip,
                                          client=types.SimpleNamespace(ray=self.client))

    def set_nodes(self, nodes: list[Node], dead: tuple[str, ...] = ()) -> None:
        """What ``ray.nodes()`` lists: ``nodes``, those in ``dead`` not alive."""
        self.node_list = [{"NodeID": n.node_id, "NodeManagerAddress": n.ip, "Alive": n.node_id not in dead,
                           "Resources": {k: v for k, v in (("GPU", n.gpus), ("CPU", n.cpus)) if v}}
                          for n in nodes]

    def agent_for(self, node_id: str, ip: str) -> FakeAgent:
        if node_id not in self.agents:
            self.agents[node_id] = FakeAgent(node_id, ip)
        return self.agents[node_id]

    def is_initialized(self):
        return self.initialized

    def init(self, address=None, **kwargs):
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def shutdown(self):
        self.initialized = False

    def nodes(self):
        return list(self.node_list)

    def remote(self, cls):
        return _ActorClass(self)

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs[:num_returns]), list(refs[num_returns:])

    def put(self, value):
        return Ref(value)

    def kill(self, agent):
        self.killed.append(agent)


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    from taas.launch.ray import reservation

    # Groups go back at once here (what most tests check); test_reservation.py tests the linger.
    monkeypatch.setattr(reservation, "LINGER", 0.0)
    ray = FakeRay()
    util = types.ModuleType("ray.util")
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.NodeAffinitySchedulingStrategy = lambda node_id, soft: ("affinity", node_id, soft)
    groups = types.ModuleType("ray.util.placement_group")
    groups.placement_group = ray.groups.placement_group
    groups.remove_placement_group = ray.groups.remove_placement_group
    for name, module in (("ray", ray), ("ray.util", util),
                         ("ray.util.scheduling_strategies", strategies),
                         ("ray.util.placement_group", groups)):
        monkeypatch.setitem(sys.modules, name, module)
    return ray
