"""A detached job on this machine is made by the kernel's Session exactly as an attached cell's
job (Session.detached_job) and run by its host as it is (taas.host.main.run_prepared): real
processes, one machine, gloo on loopback."""

from __future__ import annotations

import os
import time

import pytest

from taas import directive
from taas.host import client, main
from taas.host.api import Prepared
from taas.host.sink import RecordSink
from taas.jobs import api as records
from taas.jobs.api import JobRecord, State
from taas.jobs.log import LogWriter
from taas.jobs.store import Store
from taas.session import Session
from tests.support.processes import wait_for
from tests.support.scripted import Sink

CELL = """
import torch
import torch.distributed as dist
t = torch.tensor([float(big.sum())], dtype=torch.float64)
dist.all_reduce(t)
total = t.item()
print("rank", dist.get_rank(), "total", total, flush=True)
"""


@pytest.mark.parametrize("kind", ["tensor", "array"])
def test_a_job_prepared_by_the_kernel_runs_in_its_host_as_it_is_its_big_value_by_file(tmp_path, monkeypatch, kind):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    store = Store(tmp_path / "jobs")
    kernel, host = Session(), Session()  # the host's launcher runs the job, as in a job host
    big = torch.ones(1 << 19, dtype=torch.float64)  # 4 MiB: past the big values' threshold
    if kind == "array":  # a numpy array travels as a named file, which the host's launcher removes
        big = big.numpy().copy()
    seen: dict = {}

    def hand_over(job, shown, showed):  # what client.start and the host's main() do, in one process
        seen["fds"], seen["pickled"], seen["id"] = len(job.shared_fds), len(job.payload.names), job.job_id
        seen["files"] = sum(len(args[0]) for _, args in job.cleanups)  # named files, removed at the end
        record = JobRecord(id="abc123", state=State.WAITING, ranks=job.world.size, where="this machine",
                           started=time.time())
        folder = store.create(record)
        job.shared_fds = tuple(os.dup(fd) for fd in job.shared_fds)  # the host's own, as SCM_RIGHTS gives
        out = LogWriter(folder)
        sink = RecordSink(folder, out, LogWriter(folder, part=records.METRICS))
        try:
            return main.run_prepared(host.launcher, store, record, Prepared(job, shown=shown), sink,
                                     lambda: seen.setdefault("running", True))
        finally:
            sink.close()
            out.close()

    try:
        record = kernel.detached_job(CELL, {"big": big}, directive.parse_options("--gpus 2 --detach"),
                                     job_name="abc123", hand_over=hand_over, sink=Sink())
    finally:
        kernel.close()
        host.close()
    assert record.state is State.DONE and record.has_results, record
    assert seen.get("running")  # the record said running, and the kernel was told, once the ranks ran
    # The notebook's tensor went by file (the resident memory's, or a named one the host's
    # launcher removes at the end), not inside the pickle.
    assert (seen["fds"] >= 1 or seen["files"] >= 1) and seen["pickled"] < (1 << 20), seen
    if kind == "array":
        assert seen["files"] >= 1, seen
    values, _, _, notes = client.load(client.take(store, record))
    assert values["total"] == 2.0 * (1 << 19) and not notes  # both ranks read it, and all-reduced
    wait_for(lambda: not [n for n in os.listdir("/dev/shm") if seen["id"] in n], timeout=30,
             what="the job's shared files removed by the host's launcher")


def test_a_take_brings_its_lock_and_every_shared_file_past_what_one_message_carries(tmp_path):
    import socket
    import types

    from taas.host import spares
    from taas.host.api import FDS_AT_ONCE

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    files = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(FDS_AT_ONCE + 50)]  # 2 messages
    lock = os.open(tmp_path, os.O_RDONLY)
    try:
        spares._Spare.give(types.SimpleNamespace(sock=ours), tmp_path / "job", lock, files)
        take, got_lock, shared = main._wait_for_job(theirs)
        assert take.folder == str(tmp_path / "job") and take.fds == len(files)
        assert len(shared) == len(files) and got_lock >= 0
        # The same files, in the same order.
        assert [os.fstat(fd).st_ino for fd in shared] == [os.fstat(fd).st_ino for fd in files]
        for fd in [got_lock, *shared]:
            os.close(fd)
    finally:
        for fd in [*files, lock]:
            os.close(fd)
        ours.close()
        theirs.close()
