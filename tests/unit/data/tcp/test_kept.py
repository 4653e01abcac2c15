"""Kept ranks (--keep) over the TCP transport: the kernel's mark of a failed loader worker
reaches every relay (also one that registers after it), and the views on its node raise it
where the cell asks for a unit; a view released at a kept cell's end leaves no fd, mapping or
thread of the job behind, and the relay ends once its ranks closed their views."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from taas import directive
from taas.data.plane import DataPlane
from taas.data.tcp.relay import fifo_directory
from taas.data.transport import attach, resolve
from taas.data.view import LoaderFailed, LoaderView
from tests.support.data import job_shm
from tests.support.forks import exit_code, fork_job_process, no_leftover_children  # noqa: F401 (an autouse fixture)
from tests.support.processes import own_fds, own_shm_maps

TCP = "taas.data.tcp.transport:TcpTransport"
LINE = "loader:data:0 failed: ValueError: sample 1 is corrupt"


def _plane(registered, units: int) -> DataPlane:
    data = registered([torch.full((3,), float(i)) for i in range(units)])
    plane = DataPlane.plan({"data": data}, directive.parse_options(f"--gpus 1 --cpus 1 --units {units}"), 1, "cpu")
    plane.open(uuid.uuid4().hex[:12], TCP)
    return plane


def _relay(plane: DataPlane, tmp_path) -> int:
    specs = [s for s in plane.processes({}) if s.key.startswith("data-relay:")]
    (spec,) = specs
    pid = fork_job_process(resolve(spec.entry), spec, str(tmp_path))
    deadline = time.monotonic() + 60
    while not os.path.isdir(fifo_directory(plane.job_id, 0)):  # bounded wait for its set-up
        assert time.monotonic() < deadline, "the relay did not set up"
        time.sleep(0.01)
    return pid


def test_a_failed_worker_marked_by_the_kernel_reaches_the_relay_and_the_view_raises_it(registered, tmp_path):
    plane = _plane(registered, 4)
    try:
        pid = _relay(plane, tmp_path)
        cfg = plane.settings["data"]
        worker = attach(cfg["address"])
        worker.worker(0)
        assert worker.sender(0).put(0, torch.zeros(3))  # one unit arrives; the worker dies before the next
        view = LoaderView(cfg, 0)
        batches = iter(view)
        assert next(batches).tolist() == [0.0] * 3
        assert view._endpoint.failure() is None
        assert plane.fail("loader:data:0", LINE) and not plane.fail("rank0", "x")
        assert view._endpoint.failure() == LINE  # marked when fail() returns: the relay answered
        with pytest.raises(LoaderFailed, match="sample 1 is corrupt"):
            next(batches)
        view._close()
        worker.close()
        assert exit_code(pid) == 0  # its only rank closed its view: the relay ends
    finally:
        plane.close()
    assert job_shm(plane.job_id) == []


def test_a_failure_marked_before_the_relay_registered_comes_with_its_layout(registered, tmp_path):
    plane = _plane(registered, 4)
    try:
        plane.fail("loader:data:0", LINE)  # the worker failed at once: no relay yet
        pid = _relay(plane, tmp_path)
        view = LoaderView(plane.settings["data"], 0)
        with pytest.raises(LoaderFailed, match="sample 1 is corrupt"):
            view._await_prefetch()  # the first slice never comes: raised while the rank waits
        view._close()
        assert exit_code(pid) == 0
    finally:
        plane.close()
    assert job_shm(plane.job_id) == []


def test_a_released_view_frees_its_fds_mappings_and_thread(registered, tmp_path):
    plane = _plane(registered, 2)
    job_id = plane.job_id
    try:
        pid = _relay(plane, tmp_path)
        cfg = plane.settings["data"]
        worker = attach(cfg["address"])
        worker.worker(0)
        assert worker.sender(0).put(0, torch.zeros(200_000))  # a block of its own
        fds = own_fds()
        threads = threading.active_count()
        view = LoaderView(cfg, 0)
        first = next(iter(view))
        assert own_shm_maps(job_id)
        view._close()
        view._release()  # the reader waits for unit 1 that never comes: it leaves on the close
        del first
        deadline = time.monotonic() + 10
        while ((threading.active_count() > threads or own_fds() - fds or own_shm_maps(job_id))
               and time.monotonic() < deadline):
            time.sleep(0.05)  # the reader thread leaves, then releases: a bounded wait for it
        assert threading.active_count() <= threads
        assert own_fds() - fds == set()  # FIFOs and the node's header: nothing of the view stays
        assert own_shm_maps(job_id) == []
        with pytest.raises(RuntimeError, match="from an earlier cell"):
            iter(view)
        worker.close()
        assert exit_code(pid) == 0
    finally:
        plane.close()
    assert job_shm(job_id) == []
