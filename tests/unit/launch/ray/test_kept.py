"""Kept ranks on the Ray launcher without Ray: RayJob's kept-ranks calls (taas.launch.ray.kept)
fan out to the node agents and gather their answers; a dead agent or an ended rank is lost state."""

from __future__ import annotations

import types

import pytest

from taas.errors import KeptRanksGone, LaunchError
from taas.launch.api import ProcessExit
from taas.launch.ray.kept import KeptCalls


class Dead(Exception):
    """What Ray raises for a call to an agent that died."""


class Call:
    def __init__(self, agent, name):
        self.agent, self.name = agent, name

    def remote(self, *args):
        self.agent.calls.append((self.name, args))
        if self.agent.dead:
            return Dead("the actor died")
        return getattr(self.agent, "do_" + self.name)(*args)


class Agent:
    def __init__(self, ranks, rss=0):
        self.ranks, self.rss, self.dead, self.gone = ranks, rss, False, None
        self.refuses = None  # what its next_cell raises (as Ray does: a RayTaskError with the cause)
        self.calls = []

    def __getattr__(self, name):
        return Call(self, name)

    def do_lost(self):
        return self.gone

    def do_next_cell(self, files, payload, result):
        assert files == {"payload-x.pkl": b"data"}  # the object store resolved the ref
        return self.refuses

    def do_interrupt(self, keys):
        return [k for k in keys if k in self.ranks]

    def do_memory(self):
        return {k: self.rss for k in self.ranks}


class Store:
    def __init__(self):
        self.puts = 0

    def put(self, value):
        self.puts += 1
        return value

    def get(self, ref, timeout=None):
        if isinstance(ref, Exception):
            raise ref
        return ref


class Job(KeptCalls):
    def __init__(self):
        self._agents = {"a": Agent(["rank0", "rank1"], 1 << 20), "b": Agent(["rank2", "rank3"], 2 << 20)}
        self._node_of = {"rank0": "a", "rank1": "a", "rank2": "b", "rank3": "b"}
        self._ip_of = {"a": "127.0.1.1", "b": "127.0.1.2"}
        self._ranks = set(self._node_of)
        self._lost, self._exited, self._pending, self._polls = {}, set(), [], {}
        self._pids = {k: 100 + i for i, k in enumerate(self._node_of)}
        self._stopped = self._let_go = self.closed = False
        self._reserving = True
        self._ray = Store()
        self._copies = types.SimpleNamespace(paths={})  # every node sees the working directory

    def _wait(self, timeout):
        pass

    def _lose(self, node_id):
        self._lost[node_id] = 0.0


def test_a_cell_goes_to_every_agent_with_the_payload_put_once():
    job = Job()
    job.next_cell({"payload-x.pkl": b"data"}, "payload-x.pkl", "result-x.pkl")
    assert job._ray.puts == 1
    for agent in job._agents.values():
        assert ("next_cell", ({"payload-x.pkl": b"data"}, "payload-x.pkl", "result-x.pkl")) in agent.calls


@pytest.mark.parametrize("how, why", [
    ("exit", "rank2 ended (signal 9)"),
    ("agent says", "rank3 ended (exit code 1)"),
    ("dead agent", "taas's agent on node 127.0.1.2 did not answer"),
    ("stopped", "the job's processes were stopped"),
])
def test_lost_state_is_named_and_no_cell_is_sent(how, why):
    job = Job()
    if how == "exit":
        job._pending.append(ProcessExit("rank2", 102, -9))
    elif how == "agent says":
        job._agents["b"].gone = "rank3 ended (exit code 1)"
    elif how == "dead agent":
        job._agents["b"].dead = True
    else:
        job._stopped = True
    assert why in (job.lost() or "")
    with pytest.raises(LaunchError, match="the kept ranks are gone"):
        job.next_cell({"payload-x.pkl": b"data"}, "payload-x.pkl", "result-x.pkl")
    assert not any(name == "next_cell" for a in job._agents.values() for name, _ in a.calls)
    if how == "dead agent":
        assert "b" in job._lost and "died" in job.lost()


def test_interrupt_reaches_each_rank_through_its_nodes_agent():
    job = Job()
    job._exited.add("rank1")
    assert sorted(job.interrupt(["rank0", "rank1", "rank3"])) == ["rank0", "rank3"]
    assert ("interrupt", (["rank3"],)) in job._agents["b"].calls


def test_percent_taas_sees_memory_and_reserved_gpus_per_node():
    job = Job()
    assert job.memory() == {"rank0": 1 << 20, "rank1": 1 << 20, "rank2": 2 << 20, "rank3": 2 << 20}
    assert job.reserved() == "GPUs reserved on the cluster: 2 on 127.0.1.1, 2 on 127.0.1.2"
    job._let_go = True
    assert job.reserved() is None


class RayTaskError(Exception):
    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def test_a_node_whose_kept_ranks_went_after_lost_looked_sends_the_cell_to_fresh_ranks():
    """A rank gone a moment before, its exit not yet reported on its node: lost() saw nothing,
    the node's agent refuses the cell; KeptRanksGone, so the session runs it on fresh ranks."""
    job = Job()
    job._agents["b"].refuses = RayTaskError(KeptRanksGone("the kept ranks on node 127.0.1.2 were ended"))
    with pytest.raises(KeptRanksGone, match="node 127.0.1.2: the kept ranks are gone: the kept ranks on node"):
        job.next_cell({"payload-x.pkl": b"data"}, "payload-x.pkl", "result-x.pkl")
    job._agents["b"].refuses = RayTaskError(LaunchError("something else"))
    with pytest.raises(LaunchError) as info:  # any other refusal stays a LaunchError
        job.next_cell({"payload-x.pkl": b"data"}, "payload-x.pkl", "result-x.pkl")
    assert not isinstance(info.value, KeptRanksGone)
