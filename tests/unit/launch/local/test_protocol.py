"""The start-process wire: every message survives the trip, and anything else is logged and ignored."""

from __future__ import annotations

import logging
import os
import pickle
import socket
from multiprocessing import Pipe

import pytest

from taas.launch.api import ProcessExit, ProcessSpec
from taas.launch.local import protocol
from taas.launch.local.job import LocalJob
from taas.launch.local.protocol import (
    Become,
    Exited,
    Ready,
    Spawn,
    Spawned,
    SpawnError,
    Stop,
    Stopped,
)

SPEC = ProcessSpec("rank0", "tests.support.launch_targets:echo", env={"A": "1"}, args=(b"x",), rank=0)

EVERY_MESSAGE = [
    Ready(123),
    Spawn("job", "/cwd", "/tmp/taas-job", (SPEC, ProcessSpec("loader0", "m:f", role="loader")), 2,
          (("tests.support.launch_targets:touch", ("/tmp/x",)),)),
    Spawned("job", {"rank0": 11, "loader0": 12}),
    SpawnError("job", "could not start the job's processes: no room"),
    Exited("job", "rank0", 11, -9),
    Stop("job", 0.5),
    Stopped("job"),
    Become(SPEC, "/cwd"),
]

# What a confused or foreign writer might put on the channel: none of it is a message.
GARBAGE = [
    b"not a pickle",
    b"",
    pickle.dumps(("spawn", "job", "/cwd", "/tmp/taas-job", [], 0, ())),  # the old tuple wire
    pickle.dumps({"kind": "display", "data": 5}),
    pickle.dumps([1, 2]),
    pickle.dumps(None),
    pickle.dumps(Spawned("job", {"rank0": "eleven"})),
    pickle.dumps(Spawned(5, {})),
    pickle.dumps(Exited("job", "rank0", 11, "-9")),
    pickle.dumps(Stop("job", "soon")),
    pickle.dumps(Spawn("job", "/cwd", "/d", ("not a spec",))),
    pickle.dumps(Spawn("job", "/cwd", "/d", (SPEC,), shared=protocol.MAX_SHARED_FDS + 1)),
    pickle.dumps(Spawn("job", "/cwd", "/d", [SPEC])),  # a list, not a tuple
    pickle.dumps(Become("rank0", "/cwd")),
    pickle.dumps(Ready(123))[:-3],  # torn
    b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x0cno.such.mod\x94\x8c\x01X\x94\x93\x94.",
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_channel(message):
    ours, theirs = Pipe()
    protocol.send(ours, message)
    received = protocol.receive(theirs)
    assert received == message and type(received) is type(message)
    assert protocol.decode(protocol.encode(message)) == message


def test_every_message_class_is_on_the_list():
    assert {type(m) for m in EVERY_MESSAGE} == set(protocol.MESSAGES)


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_logged_and_ignored(data, caplog):
    ours, theirs = Pipe()
    with caplog.at_level(logging.WARNING, logger="taas"):
        ours.send_bytes(data)
        assert protocol.receive(theirs) is None
    assert "ignored" in caplog.text
    protocol.send(ours, Stopped("job"))  # the channel is still in step
    assert protocol.receive(theirs) == Stopped("job")


def test_a_spawn_counts_its_fds():
    assert Spawn("j", "/c", "/d", (SPEC, SPEC), shared=3).fds == 2 * len(protocol.STREAMS) + 3


@pytest.mark.parametrize("count", [0, 1, protocol.FDS_PER_MESSAGE, protocol.FDS_PER_MESSAGE + 7])
def test_fds_cross_in_batches(count):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        protocol.send_fds(ours, [w] * count)
        received = protocol.recv_fds(theirs, count)
        assert len(received) == count
        for fd in received:
            assert os.path.samestat(os.fstat(fd), os.fstat(w))
            os.close(fd)
    finally:
        for closable in (ours, theirs):
            closable.close()
        os.close(r)
        os.close(w)


def test_fds_that_never_come_are_an_eof():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.close()
    with pytest.raises(EOFError):
        protocol.recv_fds(theirs, 3)
    theirs.close()


def test_a_job_reads_past_garbage_and_other_jobs_messages():
    """The kernel's end: a job waits through unreadable messages and other jobs' answers, and
    still sees its own pids and exits."""
    ours, starter = Pipe()
    lost = []
    job = LocalJob(ours, lambda: lost.append(True), "job", {}, "")
    for data in GARBAGE:
        starter.send_bytes(data)
    protocol.send(starter, Spawned("earlier", {"rank0": 1}))
    protocol.send(starter, Exited("earlier", "rank0", 1, 0))
    protocol.send(starter, Spawned("job", {"rank0": 2}))
    job.await_spawned()
    assert job.pids == {"rank0": 2} and job.running
    for data in GARBAGE:
        starter.send_bytes(data)
    protocol.send(starter, Ready(5))  # not for a job: ignored
    protocol.send(starter, Exited("job", "rank0", 2, 3))
    events = []
    while job.running:
        events.extend(job.events(1.0))
    assert events == [ProcessExit("rank0", 2, 3)]
    assert job.finished and not lost
    job.close()
