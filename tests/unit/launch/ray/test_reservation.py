"""The GPU reservation as data, on a fake ``ray`` (conftest.py): one placement group, held
while a job that asked for it runs, reused by the same shape, given back at the end."""

from __future__ import annotations

import time

import pytest

from taas.errors import LaunchError
from taas.io import keys
from taas.launch.api import LaunchSpec, ProcessExit, ProcessSpec
from taas.launch.ray.launcher import RayLauncher
from taas.launch.ray.placement import Node
from taas.launch.ray.reservation import Reservation, bundles

TWO = bundles(["10.0.1.1", "10.0.1.1"])
FOUR = bundles(["10.0.1.1", "10.0.1.1", "10.0.1.2", "10.0.1.2"])


def test_bundles_pin_one_gpu_per_rank_to_its_node():
    assert TWO == [{"GPU": 1, "node:10.0.1.1": 0.001}, {"GPU": 1, "node:10.0.1.1": 0.001}]


def test_a_group_is_held_while_a_job_holds_it(fake_ray):
    made = fake_ray.groups.made
    reservation = Reservation()
    reservation.hold(TWO, "job1")
    assert [(g.bundles, g.name) for g in made] == [(TWO, "taas-job1")]
    assert reservation.held == TWO
    reservation.hold(TWO, "job1-1")  # the next attempt before the last one closed: the same group
    assert len(made) == 1
    reservation.let_go("job1")
    assert fake_ray.groups.held == made  # job1-1 still holds it
    reservation.let_go("job1-1")
    assert fake_ray.groups.held == [] and reservation.held is None


def test_another_shape_replaces_the_group(fake_ray):
    reservation = Reservation()
    reservation.hold(TWO, "job1")
    reservation.hold(FOUR, "job2")
    first, second = fake_ray.groups.made
    assert first.removed and not second.removed and reservation.held == FOUR
    reservation.release()
    assert second.removed and reservation.held is None
    reservation.let_go("job2")  # nothing held: nothing to do


def test_a_cluster_that_does_not_reserve_is_one_line(fake_ray, monkeypatch):
    from taas.launch.ray import reservation as module

    monkeypatch.setattr(module, "TIMEOUT", 0.01)
    fake_ray.groups.ready = False
    reservation = Reservation()
    with pytest.raises(LaunchError) as info:
        reservation.hold(FOUR, "job1")
    assert str(info.value) == ("the cluster did not reserve 4 GPU(s) in 0 s: other work holds them; "
                               "try again, or use fewer --gpus")
    assert fake_ray.groups.held == [] and reservation.held is None
    fake_ray.groups.ready = True
    reservation.hold(FOUR, "job2")
    reservation.let_go("job2")
    assert fake_ray.groups.held == []


def test_the_launcher_reserves_gpus_for_a_job_and_gives_them_back_at_its_end(fake_ray, tmp_path):
    fake_ray.set_nodes([Node("a", "10.0.1.1", gpus=2, cpus=8), Node("b", "10.0.1.2", gpus=2, cpus=8)])
    launcher = RayLauncher("auto", workdir="shared")
    procs = tuple(ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r) for r in range(4))
    job = launcher.start(LaunchSpec("job1", str(tmp_path), procs))
    assert [(g.bundles, g.name) for g in fake_ray.groups.held] == [(FOUR, "taas-job1")]
    job.close()
    assert fake_ray.groups.held == []


def test_ranks_placed_by_cpu_reserve_nothing(fake_ray, tmp_path):
    fake_ray.set_nodes([Node("c", "10.0.2.1", cpus=4)])
    launcher = RayLauncher("auto", workdir="shared")
    procs = tuple(ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r) for r in range(2))
    launcher.start(LaunchSpec("job1", str(tmp_path), procs)).close()
    assert fake_ray.groups.made == []


# -- back to back: the GPUs just given back are waited for, not asked for too early --------------

class Fits:
    """What ``Reservation(fits=...)`` asks: answers in turn (the last one repeats), each call
    recorded with the groups made so far (to tell whether the group was asked for after)."""

    def __init__(self, fake_ray, *answers):
        self.fake_ray, self.answers, self.calls = fake_ray, list(answers), []

    def __call__(self, wanted):
        self.calls.append((wanted, len(self.fake_ray.groups.made)))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_right_after_a_group_went_hold_waits_until_its_gpus_are_back_then_asks(fake_ray):
    fits = Fits(fake_ray, False, False, True)
    reservation = Reservation(fits=fits)
    reservation.hold(FOUR, "job1")
    assert fits.calls == []  # nothing of ours went: the cluster's own wait
    reservation.let_go("job1")
    reservation.hold(FOUR, "job2")  # the next cell, at once
    assert [(wanted, made) for wanted, made in fits.calls] == [(FOUR, 1)] * 3  # asked only once they fit
    assert [g.name for g in fake_ray.groups.held] == ["taas-job2"]


def test_a_cluster_that_cannot_tell_is_asked_at_once(fake_ray):
    fits = Fits(fake_ray, None)
    reservation = Reservation(fits=fits)
    reservation.hold(TWO, "job1")
    reservation.let_go("job1")
    reservation.hold(TWO, "job2")
    assert len(fits.calls) == 1 and len(fake_ray.groups.held) == 1


def test_the_wait_for_returning_gpus_ends_with_its_window(fake_ray, monkeypatch):
    from taas.launch.ray import reservation as module

    monkeypatch.setattr(module, "RETURN_WINDOW", 0.05)
    fits = Fits(fake_ray, False)  # another user's job took them meanwhile
    reservation = Reservation(fits=fits)
    reservation.hold(TWO, "job1")
    reservation.let_go("job1")
    reservation.hold(TWO, "job2")  # asked after the window: the group's own wait decides
    assert fits.calls and len(fake_ray.groups.held) == 1
    reservation.let_go("job2")
    time.sleep(0.06)
    calls = len(fits.calls)
    reservation.hold(TWO, "job3")  # long after the last removal: asked at once
    assert len(fits.calls) == calls


def test_gpus_fit_per_node_where_the_driver_can_ask(fake_ray, monkeypatch):
    import sys
    import types

    from taas.launch.ray.reservation import gpus_fit

    per_node = {"id-a": {"GPU": 2.0, "node:10.0.1.1": 1.0, "CPU": 8.0},
                "id-b": {"node:10.0.1.2": 0.998, "CPU": 8.0},  # both GPUs still taken
                "head": {"node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}}
    state = types.ModuleType("ray._private.state")
    state.available_resources_per_node = lambda: per_node
    monkeypatch.setitem(sys.modules, "ray._private", types.ModuleType("ray._private"))
    monkeypatch.setitem(sys.modules, "ray._private.state", state)
    assert gpus_fit(TWO) is True
    assert gpus_fit(FOUR) is False
    per_node["id-b"]["GPU"] = 2.0
    assert gpus_fit(FOUR) is True


def test_gpus_fit_in_the_whole_cluster_through_ray_client(fake_ray):
    from taas.launch.ray.reservation import gpus_fit

    assert gpus_fit(FOUR) is None  # the fake has neither call: cannot tell
    fake_ray.available_resources = lambda: {"GPU": 3.0, "CPU": 16.0}
    assert gpus_fit(FOUR) is False and gpus_fit(TWO) is True


def test_a_job_gives_its_gpus_back_as_soon_as_its_ranks_exited(fake_ray, tmp_path):
    """Before the results are read and the job closes: Ray has them back for the next cell."""
    fake_ray.set_nodes([Node("a", "10.0.1.1", gpus=2, cpus=8), Node("b", "10.0.1.2", gpus=2, cpus=8)])
    launcher = RayLauncher("auto", workdir="shared")
    procs = tuple(ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r) for r in range(4))
    agent_b = fake_ray.agent_for("b", "10.0.1.2")
    agent_b.do_events = lambda timeout, attempt=None: ([ProcessExit("rank2", 0, 0)], False)  # rank3 runs on
    job = launcher.start(LaunchSpec("job1", str(tmp_path), procs))
    job.events(0)
    assert len(fake_ray.groups.held) == 1  # rank3 still runs: its GPU stays reserved
    agent_b.do_events = lambda timeout, attempt=None: ([ProcessExit("rank3", 0, 0)], True)
    for _ in range(3):
        job.events(0)
    assert fake_ray.groups.held == [] and not job.closed
    job.close()  # lets go again: nothing more to do
    assert len(fake_ray.groups.made) == 1


def test_a_stopped_job_gives_its_gpus_back_once_every_ranks_agent_stopped_them(fake_ray, tmp_path):
    fake_ray.set_nodes([Node("a", "10.0.1.1", gpus=2, cpus=8), Node("b", "10.0.1.2", gpus=2, cpus=8)])
    launcher = RayLauncher("auto", workdir="shared")
    procs = tuple(ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r) for r in range(4))
    for node_id, ip in (("a", "10.0.1.1"), ("b", "10.0.1.2")):
        fake_ray.agent_for(node_id, ip).do_events = lambda timeout, attempt=None: ([], False)  # the ranks run on
    job = launcher.start(LaunchSpec("job1", str(tmp_path), procs))
    job.events(0)
    assert len(fake_ray.groups.held) == 1
    job.stop()  # every rank's agent answered: its processes are reaped
    assert fake_ray.groups.held == []
    job.close()


def test_a_stop_that_a_ranks_agent_did_not_answer_keeps_the_gpus_until_close(fake_ray, tmp_path):
    fake_ray.set_nodes([Node("a", "10.0.1.1", gpus=2, cpus=8), Node("b", "10.0.1.2", gpus=2, cpus=8)])
    launcher = RayLauncher("auto", workdir="shared")
    procs = tuple(ProcessSpec(key=keys.rank_key(r), entry="m:f", rank=r) for r in range(4))
    for node_id, ip in (("a", "10.0.1.1"), ("b", "10.0.1.2")):
        fake_ray.agent_for(node_id, ip).do_events = lambda timeout, attempt=None: ([], False)
    job = launcher.start(LaunchSpec("job1", str(tmp_path), procs))

    def no_answer(grace):
        raise TimeoutError("the agent did not answer")

    fake_ray.agents["b"].do_stop = no_answer
    job.stop()
    assert len(fake_ray.groups.held) == 1  # node b's ranks may still hold their GPUs
    job.close()
    assert fake_ray.groups.held == []


def test_a_group_lingers_for_the_next_cell_then_goes_back(fake_ray, monkeypatch):
    """Run All: the next cell, asked for within LINGER s, reuses the group (no wait for GPUs on
    their way back); with nobody asking, it goes back LINGER s after its last job."""
    from taas.launch.ray import reservation as module

    monkeypatch.setattr(module, "LINGER", 30.0)
    fits = Fits(fake_ray, False)  # were the GPUs asked for afresh, they would not be back yet
    reservation = Reservation(fits=fits)
    reservation.hold(FOUR, "job1")
    reservation.let_go("job1")
    assert len(fake_ray.groups.held) == 1  # lingering
    reservation.hold(FOUR, "job2")  # the next cell, at once
    assert fits.calls == [] and [g.name for g in fake_ray.groups.made] == ["taas-job1"]
    reservation.let_go("job2")
    reservation.release()  # the launcher's shutdown: back at once, lingering or not
    assert fake_ray.groups.held == [] and reservation.held is None

    monkeypatch.setattr(module, "LINGER", 0.05)
    reservation.hold(TWO, "job3")
    reservation.let_go("job3")
    deadline = time.monotonic() + 10
    while fake_ray.groups.held and time.monotonic() < deadline:  # the linger's timer removes it
        time.sleep(0.01)
    assert fake_ray.groups.held == [] and reservation.held is None
