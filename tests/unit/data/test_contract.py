"""The transport contract: the plane, a loader worker and a rank's view use only it, so a
transport given by name serves them; a transport's cleanup hook frees everything of a job
from another process (what the launcher does when the kernel died)."""

from __future__ import annotations

import os
import pickle
import uuid

import torch

from taas import directive
from taas.data import loader_worker as worker
from taas.data.plane import DataPlane
from taas.data.transport import (
    LOADING, Address, ControlState, Endpoint, Receiver, Transport, WorkerStatus, attach, resolve,
)
from taas.data.view import LoaderView
from taas.launch.local.launcher import LocalLauncher
from taas.session import transport_for
from tests.support.data import job_shm, run_hook
from tests.support.forks import exit_code, fork_job_process, no_leftover_children  # noqa: F401 (an autouse fixture)

SHM = "taas.data.shm.transport:ShmTransport"


def test_the_session_picks_shared_memory_where_the_local_launcher_runs_jobs():
    transport = transport_for(LocalLauncher().topology(2))  # no start process is started for this
    assert issubclass(transport, Transport) and transport is resolve(SHM)


def test_plane_worker_and_view_work_with_a_transport_given_by_name(registered, tmp_path):
    data = registered([torch.full((3,), float(i)) for i in range(6)])
    plane = DataPlane.plan({"data": data}, directive.parse_options("--gpus 1 --cpus 2 --units 6"), 1, "cpu")
    job_id = uuid.uuid4().hex[:12]
    plane.open(job_id, SHM)
    pids = []
    try:
        cfg = plane.settings["data"]
        assert pickle.loads(pickle.dumps(cfg["address"])) == cfg["address"]  # it travels to ranks
        specs = plane.processes({})
        assert len(specs) == 2 and all(isinstance(s.args[0]["loader"], bytes) for s in specs)
        pids = [fork_job_process(worker.main, spec, str(tmp_path)) for spec in specs]
        view = LoaderView(cfg, 0)
        view._await_prefetch()
        got = [t for t in view]
        assert [t.tolist() for t in got] == [[float(i)] * 3 for i in range(6)]
        view._close()
        assert [exit_code(pid) for pid in pids] == [0, 0]
        pids = []
        snapshot = plane.snapshot()
        assert [s["worker"] for s in snapshot] == [0, 1]
        assert all(s["prefetched"] and s["waiting"] is None for s in snapshot)
        assert job_shm(job_id)
        (entry, args), = plane.cleanups()
        assert resolve(entry) and pickle.loads(pickle.dumps(args)) == args
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        plane.close()
    assert job_shm(job_id) == []


def test_cleanup_hook_in_another_process_leaves_no_segment_and_no_fifo_dir():
    """A kernel that died with a job running: the launcher runs the transport's hook."""
    job_id = uuid.uuid4().hex[:12]
    transport = resolve(SHM)(job_id)
    try:
        address = transport.channels(0, 1, [(0, 0)], 8 << 20)  # room for all three
        endpoint = attach(address)
        tx, rx = endpoint.sender(0), endpoint.receiver(0)
        for u in range(3):  # lent blocks: the producer made segments of its own
            assert tx.put(u, torch.full((100_000,), float(u)))
        value, _ = rx.take()
        assert torch.equal(value, torch.zeros(100_000))
        directory = transport.cleanup()[1][1]
        assert len(job_shm(job_id)) > 1 and os.listdir(directory)
        run_hook(transport.cleanup())  # the kernel never closed its transport
        assert job_shm(job_id) == []
        assert not os.path.exists(directory)
        tx.close()
        rx.close()
    finally:
        transport.close()  # idempotent after the hook


# -- a second transport: the plane reads control state and hooks only through the contract ------
class _Inert(Receiver):
    def peek(self):
        raise AssertionError("not used")

    def take(self):
        raise AssertionError("not used")

    def skip(self):
        raise AssertionError("not used")


class FakeEndpoint(Endpoint):
    def sender(self, channel, on_wait=None):
        raise AssertionError("not used")

    def worker(self, worker):
        raise AssertionError("not used")

    def receiver(self, channel, pin_memory=False):
        return _Inert()

    def want(self, channel, unit):
        pass

    def prefetched(self, worker):
        return True


class FakeTransport(Transport):
    """Worker 1 of loader 0 loads unit 7 for 4 s while rank 1 (channel 1) waits for it."""

    instances: list = []

    def __init__(self, job_id):
        super().__init__(job_id)
        self.made, self.closed = {}, False
        FakeTransport.instances.append(self)

    def channels(self, loader, workers, pairs, buffer_bytes):
        self.made[loader] = (workers, list(pairs), buffer_bytes)
        return Address(f"{__name__}:FakeEndpoint", {"loader": loader})

    def control(self, loader):
        workers = [WorkerStatus(LOADING, 6, 0.5, True, 3), WorkerStatus(LOADING, 7, 4.0, True, 3)]
        return ControlState(workers, {1: (7, 2.5)})

    def close(self):
        self.closed = True

    def cleanup(self):
        return (f"{__name__}:FakeTransport", (self.job_id,))


def test_the_plane_uses_any_transport_through_the_contract(registered):
    data = registered(list(range(20)))
    options = directive.parse_options("--gpus 2 --cpus 2 --units 20 --timeout 9")
    plane = DataPlane.plan({"data": data}, options, 2, "cpu")
    plane.open("fakejob", FakeTransport)
    transport = FakeTransport.instances[-1]
    assert transport.job_id == "fakejob"
    workers, pairs, buffer_bytes = transport.made[0]
    assert workers == 2 and pairs == [(0, 0), (1, 1)] and buffer_bytes > 0
    assert plane.settings["data"]["address"] == Address(f"{__name__}:FakeEndpoint", {"loader": 0})
    assert plane.cleanups() == ((f"{__name__}:FakeTransport", ("fakejob",)),)
    view = LoaderView(plane.settings["data"], 1)  # a rank attaches by the address alone
    assert list(view._rx) == [1] and isinstance(view._rx[1], _Inert) and len(view) == 10
    view._reader.stop()
    plane.note_timeout()
    hung = plane.hang(9.0)
    assert hung is not None and "worker 1 (loader:data:1) spent 4.0 s loading unit 7" in str(hung)
    assert "rank1 waited 2.5 s for unit 7" in str(hung)
    plane.close()
    assert transport.closed
