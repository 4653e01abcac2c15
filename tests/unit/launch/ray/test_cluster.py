"""The cluster connection and its agent pool, on a fake ``ray`` (conftest.py)."""

from __future__ import annotations

import os

import pytest

from taas.errors import LaunchError
from taas.launch.ray.cluster import RayCluster, connect_error, message
from taas.launch.ray.placement import Node

A = Node("a", "10.0.1.1", 2, 8)
B = Node("b", "10.0.1.2", 2, 8)


def test_one_agent_per_node_pinned_there_and_started_once(fake_ray):
    cluster = RayCluster("auto")
    agent = cluster.agent(A)
    assert cluster.agent(A) is agent and fake_ray.started_agents == ["a"]
    assert fake_ray.initialized  # connected on first use


def test_a_forgotten_agent_is_killed_and_its_answers_go_with_it(fake_ray, tmp_path):
    cluster = RayCluster("auto")
    assert cluster.info([A, B])["a"]["cuda"] == 0
    assert set(cluster.described()) == {"a", "b"}
    assert cluster.copy_nodes(["a", "b"], str(tmp_path), "auto") == set()
    agent = fake_ray.agents["a"]
    cluster.forget("a")
    assert fake_ray.killed == [agent] and set(cluster.described()) == {"b"}
    cluster.forget("a")  # twice is fine
    agent.cuda, agent.shares = 2, False
    assert cluster.info([A])["a"]["cuda"] == 2  # asked again
    assert cluster.copy_nodes(["a", "b"], str(tmp_path), "auto") == {"a"}
    assert len(fake_ray.agents["b"].called("sees")) == 1  # b's answer was kept


def test_an_agent_that_does_not_start_is_one_line(fake_ray):
    fake_ray.agent_for("a", "10.0.1.1").dead = True
    with pytest.raises(LaunchError) as info:
        RayCluster("auto").info([A])
    assert str(info.value) == ("taas could not start its agent on node 10.0.1.1: "
                               "The actor died unexpectedly on node 10.0.1.1")
    assert fake_ray.killed == [fake_ray.agents["a"]]


def test_copy_nodes_by_mode(fake_ray, tmp_path):
    cluster = RayCluster("auto")
    cluster.agent(A)
    cluster.agent(B).shares = False
    assert cluster.copy_nodes(["a", "b"], str(tmp_path), "shared") == set()
    assert cluster.copy_nodes(["a", "b"], str(tmp_path), "copy") == {"a", "b"}
    assert cluster.copy_nodes(["a", "b"], str(tmp_path), "auto") == {"b"}
    (marker, content), = fake_ray.agents["a"].called("sees")
    assert os.path.dirname(marker) == str(tmp_path) and len(content) == 16
    assert os.listdir(tmp_path) == []  # the marker is gone


def test_a_directory_the_kernel_cannot_write_is_copied_nowhere(fake_ray, tmp_path):
    cluster = RayCluster("auto")
    cluster.agent(A).shares = False
    assert cluster.copy_nodes(["a"], str(tmp_path / "missing"), "auto") == set()


def test_a_failed_connection_is_one_line(fake_ray):
    fake_ray.init_error = ConnectionError("Failed to connect to GCS at 10.0.0.1:6379")
    with pytest.raises(LaunchError) as info:
        RayCluster("10.0.0.1:6379").nodes()
    assert str(info.value) == ("cannot connect to the Ray cluster at '10.0.0.1:6379': "
                               "Failed to connect to GCS at 10.0.0.1:6379")


def test_connect_error_names_what_the_user_sets():
    class AuthenticationError(Exception):
        pass

    try:
        try:
            raise AuthenticationError("bad")
        except AuthenticationError as inner:
            raise ConnectionError("Failed to connect") from inner
    except ConnectionError as exc:
        refused = exc
    assert "refused this kernel's authentication token" in connect_error("auto", refused)
    timeout = ConnectionError("ray client connection timeout")
    assert "its Ray Client server did not answer" in connect_error("ray://head:10001", timeout)
    assert "\n" not in connect_error("ray://head:10001", timeout)


def test_message_is_the_last_line_of_the_cause():
    error = RuntimeError("wrapper")
    error.cause = LaunchError("Traceback ...\nLaunchError: no room")  # as a RayTaskError carries it
    assert message(error) == "LaunchError: no room"
    assert message(RuntimeError("")) == "RuntimeError"
