"""A kept rank's views (--keep): the kernel's mark of a failed loader worker reaches the view,
which raises it where the cell asks for a unit; a view released at a cell's end leaves no fd,
no mapping and no thread behind, and says so when a later cell iterates it."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from taas import directive
from taas.data.plane import DataPlane
from taas.data.transport import attach
from taas.data.view import LoaderFailed, LoaderView
from tests.support.processes import own_fds, own_shm_maps

SHM = "taas.data.shm.transport:ShmTransport"


def _plane(registered, units: int):
    data = registered([torch.full((3,), float(i)) for i in range(units)])
    plane = DataPlane.plan({"data": data}, directive.parse_options(f"--gpus 1 --cpus 1 --units {units}"), 1, "cpu")
    plane.open(uuid.uuid4().hex[:12], SHM)
    return plane


def test_a_failed_worker_marked_by_the_kernel_is_raised_where_the_cell_waits(registered):
    plane = _plane(registered, 4)
    try:
        cfg = plane.settings["data"]
        tx = attach(cfg["address"]).sender(0)
        assert tx.put(0, torch.zeros(3))  # one unit arrives; the worker dies before the next
        view = LoaderView(cfg, 0)
        batches = iter(view)
        assert next(batches).tolist() == [0.0] * 3
        line = "loader:data:0 failed: ValueError: sample 1 is corrupt"
        assert plane.fail("loader:data:0", line) and not plane.fail("rank0", "x")
        with pytest.raises(LoaderFailed, match="sample 1 is corrupt"):
            next(batches)
        view._close()
    finally:
        plane.close()


def test_a_released_view_frees_its_fds_mappings_and_thread(registered):
    plane = _plane(registered, 2)
    job_id = plane.job_id
    try:
        cfg = plane.settings["data"]
        tx = attach(cfg["address"]).sender(0)
        assert tx.put(0, torch.zeros(200_000))  # a block of its own (not copied)
        fds = own_fds()
        threads = threading.active_count()
        view = LoaderView(cfg, 0)
        first = next(iter(view))
        assert own_shm_maps(job_id)
        view._close()
        view._release()  # the reader waits for unit 1 that never comes: it leaves on the close
        del first
        deadline = threading.Event()
        for _ in range(40):
            if threading.active_count() <= threads and not own_fds() - fds:
                break
            deadline.wait(0.05)
        assert threading.active_count() <= threads
        assert own_fds() - fds == set()  # FIFOs, and the mappings (each keeps a descriptor)
        with pytest.raises(RuntimeError, match="from an earlier cell"):
            iter(view)
    finally:
        plane.close()
