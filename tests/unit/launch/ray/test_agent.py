"""The Ray launcher's node agent without Ray: a LocalLauncher running a job whose rendezvous was
placed elsewhere (LaunchSpec.placed), output through long polls, stop from another thread."""

from __future__ import annotations

import dataclasses
import threading
import time

import psutil
import pytest

from taas.launch.api import LaunchSpec, OutputChunk, ProcessExit, ProcessSpec
from taas.launch.ray.agent import NodeAgent
from taas.launch.rendezvous import Placement, torchrun_env


@pytest.fixture(scope="module")
def agent():
    mp = pytest.MonkeyPatch()
    mp.setenv("TAAS_NODE_ID", "")  # the agent sets it for its process: undone afterwards
    agent = NodeAgent("node-under-test", "127.0.0.1")
    yield agent
    starter = agent._launcher._proc
    agent.shutdown()
    if starter is not None:
        assert starter.poll() is not None
    mp.undo()


def spec(tmp_path, entry, n, envs=None):
    return LaunchSpec(
        job_id=f"a{time.monotonic_ns()}", cwd=str(tmp_path),
        processes=tuple(ProcessSpec(key=f"rank{r}", entry=f"tests.support.launch_targets:{entry}",
                                    env=(envs or {}).get(r, {}), rank=r) for r in range(n)),
        placed=True)


def collect(agent, timeout=120.0):
    out, exits = {}, {}
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the job did not finish"
        events, finished = agent.events(1.0)
        for ev in events:
            if isinstance(ev, OutputChunk):
                out[(ev.key, ev.stream)] = out.get((ev.key, ev.stream), b"") + ev.data
            elif isinstance(ev, ProcessExit):
                exits[ev.key] = ev.returncode
        if finished:
            return out, exits


def gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_a_placed_job_uses_the_given_rendezvous_and_the_agents_store(agent, tmp_path):
    ip, port = agent.host_store("attempt-1", 2)
    assert ip == "127.0.0.1" and port > 0
    envs = {r: torchrun_env(Placement(r, r, 2), 2, ip, port, "run") for r in range(2)}
    pids = agent.start(spec(tmp_path, "rendezvous_sum", 2, envs), {"payload.pkl": b"x"})
    out, exits = collect(agent)
    assert exits == {"rank0": 0, "rank1": 0}, out
    for r in range(2):
        line = out[(f"rank{r}", "stdout")].decode()
        assert (f"RANK={r} LOCAL_RANK={r} GROUP_RANK=0 TAAS_NODE_ID=node-under-test "
                "GLOO_SOCKET_IFNAME=lo sum=3 job_dir") in line, line
    agent.close()
    agent.close_store("attempt-1")
    assert gone(pids.values())


def test_shared_bytes_become_files_of_every_process(agent, tmp_path):
    agent.start(spec(tmp_path, "read_shared", 2), {}, b"first", b"second")
    out, exits = collect(agent)
    assert exits == {"rank0": 0, "rank1": 0}
    assert out[("rank1", "stdout")] == b"first|second\n"
    agent.close()


def test_stop_while_a_long_poll_waits(agent, tmp_path):
    pids = agent.start(spec(tmp_path, "hang", 2), {})
    polled = []
    poller = threading.Thread(target=lambda: polled.append(collect(agent)))
    poller.start()
    agent.stop(0.5)
    poller.join(60)
    assert not poller.is_alive()
    _, exits = polled[0]
    assert set(exits) == {"rank0", "rank1"} and all(code < 0 for code in exits.values()), exits
    agent.close()
    assert gone(pids.values())


def test_a_loader_job_runs_beside_kept_ranks_and_ends_alone(agent, tmp_path):
    """--keep with registered loaders: a cell's loader job (here a relay-like process, no rank)
    starts next to the kept ranks' job; each job's events, stop and close are its own, the
    kept-ranks calls go to the kept job, and a new loader job replaces one left open."""
    kept = dataclasses.replace(spec(tmp_path, "hang", 2), processes=tuple(
        dataclasses.replace(p, env={"TAAS_KEEP": "1"}) for p in spec(tmp_path, "hang", 2).processes))
    kept_pids = agent.start(kept, {})

    def loader_job(name):
        return LaunchSpec(job_id=name, cwd=str(tmp_path), placed=True, processes=(
            ProcessSpec(key="data-relay:0", entry="tests.support.launch_targets:hang", role="relay", node=0),))

    first = agent.start(loader_job(f"a{time.monotonic_ns()}-data"), {})
    second_spec = loader_job(f"a{time.monotonic_ns()}-data")
    second = agent.start(second_spec, {})  # the first was never closed: replaced
    assert gone(first.values())
    assert agent.lost() is None and set(agent.memory()) == {"rank0", "rank1"}
    assert agent.interrupt(["data-relay:9"]) == []  # no such process in any job here
    agent.stop(0.5, second_spec.attempt)
    exits = {}
    deadline = time.monotonic() + 60
    while "data-relay:0" not in exits:
        assert time.monotonic() < deadline, "the loader job's exit never came"
        events, _ = agent.events(1.0, second_spec.attempt)
        exits.update({e.key: e.returncode for e in events if isinstance(e, ProcessExit)})
    assert set(exits) == {"data-relay:0"}  # the kept job's events are its own
    agent.close(second_spec.attempt)
    assert gone(second.values())
    assert all(psutil.pid_exists(p) for p in kept_pids.values()) and agent.lost() is None
    agent.close()
    assert gone(kept_pids.values())


def test_no_job_reports_finished_at_once(agent):
    assert agent.events(5.0) == ([], True)
    assert agent.fetch("rank0", "result.pkl") is None and agent.layers() == []


def test_a_slow_kernel_is_not_taken_for_a_dead_one_and_a_gone_one_ends_the_job(tmp_path, monkeypatch):
    """The watchdog ends a node's job when the kernel is gone (an event: ``kernel_gone()``
    says so), and never because the kernel was slow to poll while it can tell."""
    import taas.launch.ray.agent as ray_agent

    monkeypatch.setenv("TAAS_NODE_ID", "")
    monkeypatch.setattr(ray_agent, "WATCH_EVERY", 0.05)
    monkeypatch.setattr(ray_agent, "SILENT", 0.2)  # a silence this short would end the job ...
    said = {"gone": False}
    watched = threading.Event()

    def kernel_gone():
        watched.set()
        return said["gone"]

    agent = NodeAgent("node-under-test", "127.0.0.1", kernel_gone)
    try:
        pids = agent.start(spec(tmp_path, "hang", 2), {})
        since = time.monotonic()
        while time.monotonic() - since < 3 * ray_agent.SILENT:  # ... but the kernel is known
            watched.clear()                                      # alive: looks, and no end
            assert watched.wait(60)
        assert agent._job is not None and not agent._job.finished
        assert all(psutil.pid_exists(p) for p in pids.values())
        said["gone"] = True
        assert gone(list(pids.values()), timeout=60)
        assert agent._job is None
    finally:
        agent.shutdown()
