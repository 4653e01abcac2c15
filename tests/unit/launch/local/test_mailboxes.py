"""The start process's answers reach the job they are about, whichever live job reads the
channel (kept ranks and a kept cell's loader job run side by side: taas.launch.local.mailboxes)."""

from __future__ import annotations

import select
from multiprocessing import Pipe

from taas.launch.api import ProcessExit
from taas.launch.local import protocol
from taas.launch.local.job import LocalJob
from taas.launch.local.mailboxes import Mailboxes
from taas.launch.local.protocol import Exited, Spawned, Stop, Stopped


def _jobs(*ids):
    ours, starter = Pipe()
    mail = Mailboxes()
    lost: list = []
    jobs = [LocalJob(ours, lambda: lost.append(True), job_id, {}, "", mailboxes=mail) for job_id in ids]
    return starter, mail, jobs, lost


def _spawned(starter, job, pids):
    protocol.send(starter, Spawned(job.job_id, pids))
    job.await_spawned()


def _events(job, until: int, timeout: float = 2.0) -> list:
    out: list = []
    for _ in range(int(timeout / 0.05)):
        out.extend(job.events(0.05))
        if len(out) >= until:
            break
    return out


def test_a_job_that_reads_another_live_jobs_exit_leaves_it_to_that_job():
    starter, mail, (kept, loaders), lost = _jobs("kept", "loaders")
    _spawned(starter, kept, {"rank0": 1, "rank1": 2})
    _spawned(starter, loaders, {"loader:x:0": 3})
    # The kept ranks' exit arrives while the loader job waits on the channel.
    protocol.send(starter, Exited("kept", "rank1", 2, -9))
    protocol.send(starter, Exited("loaders", "loader:x:0", 3, 0))
    assert _events(loaders, 1) == [ProcessExit("loader:x:0", 3, 0)]
    assert kept.lost() == "rank1 ended (signal 9)"  # read by the other job, not lost
    assert kept.events(0) == [ProcessExit("rank1", 2, -9)]
    assert not lost
    for job in (loaders, kept):
        job._stopped = True  # nothing to stop: no start process behind this pipe
        job.close()
    assert "kept" not in mail and "loaders" not in mail


def test_a_new_jobs_start_passes_on_the_kept_jobs_messages():
    """The loader job is started while the kept ranks live: their exits that arrive before its
    Spawned are not dropped."""
    starter, mail, (kept,), _ = _jobs("kept")
    _spawned(starter, kept, {"rank0": 1})
    protocol.send(starter, Exited("kept", "rank0", 1, 1))
    protocol.send(starter, Spawned("loaders", {"loader:x:0": 2}))
    loaders = LocalJob(kept._conn, lambda: None, "loaders", {}, "", mailboxes=mail)
    loaders.await_spawned()
    assert loaders.pids == {"loader:x:0": 2}
    assert kept.events(0) == [ProcessExit("rank0", 1, 1)]


def test_stopping_one_job_hears_its_stopped_through_the_other():
    starter, mail, (kept, loaders), _ = _jobs("kept", "loaders")
    _spawned(starter, kept, {"rank0": 1})
    _spawned(starter, loaders, {"loader:x:0": 2})
    protocol.send(starter, Stopped("loaders"))  # as if in answer to its Stop
    protocol.send(starter, Exited("loaders", "loader:x:0", 2, -15))
    assert kept.events(0.5) == []  # read by the kept job: for the loader job
    loaders.stop(0.1)  # sends Stop; its Stopped is already in its box
    assert isinstance(protocol.receive(starter), Stop)
    assert loaders.events(0) == [ProcessExit("loader:x:0", 2, -15)]


def test_a_message_about_an_ended_job_is_dropped():
    starter, mail, (kept,), _ = _jobs("kept")
    _spawned(starter, kept, {"rank0": 1})
    protocol.send(starter, Exited("ended", "rank0", 9, 0))
    protocol.send(starter, Exited("kept", "rank0", 1, 0))
    assert _events(kept, 1) == [ProcessExit("rank0", 1, 0)]
    mail.route(Exited("ended", "rank0", 9, 0))  # no box: nothing kept
    assert "ended" not in mail


def test_a_job_waits_on_one_descriptor():
    """What lets a caller wait on the kept ranks and the loader job at once (celldata.Both)."""
    starter, _, (kept,), _ = _jobs("kept")
    _spawned(starter, kept, {"rank0": 1})
    fd = kept.fileno()
    assert fd is not None
    assert select.select([fd], [], [], 0)[0] == []
    protocol.send(starter, Exited("kept", "rank0", 1, 0))
    assert select.select([fd], [], [], 2.0)[0] == [fd]
