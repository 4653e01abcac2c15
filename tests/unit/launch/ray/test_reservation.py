"""The GPU reservation as data, on a fake ``ray`` (conftest.py): one placement group, held
while a job that asked for it runs, reused by the same shape, given back at the end."""

from __future__ import annotations

import pytest

from taas.errors import LaunchError
from taas.io import keys
from taas.launch.api import LaunchSpec, ProcessSpec
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
