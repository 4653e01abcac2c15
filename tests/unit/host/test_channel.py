"""A kept job's socket (taas.host.channel, taas.host.kept, taas.host.adopt) as data and as a
real unix socket between threads: every typed message both ways, frames that are not ours
refused, the per-job secret (0600, compared in constant time, checked before anything else),
one adopting kernel at a time, its questions between cells, and release -- against a Session
stand-in (no ranks)."""

from __future__ import annotations

import math
import os
import socket
import stat
import threading

import pytest

from taas.host import channel
from taas.host.adopt import Door
from taas.host.api import (SECRET, SOCKET, WIRE, Answer, Ask, CellFailed, Ended, Hello, Interrupt, JobDone, KeptAnswer,
                           KeptCall, Metrics, Refused, RunJob, Show, Welcome)
from taas.host.cells import failure_raised
from taas.host.kept import KeptHost
from taas.jobs.api import State
from taas.jobs.store import JobError, Store
from tests.support.jobs import make_record
from tests.support.kept_session import KeptSession

SAMPLES = [Hello("ab" * 32, 42, "train.ipynb"), Welcome("a1b2c3", 2, "cpu", "gloo", "k1", 30.0, 3),
           Refused("taas: no"), Interrupt(), Show("write", ["stdout", "hi\n"]),
           Metrics(1, [[0, {"loss": 1.0}]]), CellFailed("boom", ["line 1", "line 2"], "JobFailed"),
           Ended("taas: released"),
           # the kernel's own job host (taas.host.serve, taas.host.remote)
           RunJob(2, {"<cell 3>": "Cell In[3]"}, True, math.inf, "a1b2c3"), Ask("[rank1] name? ", True),
           Answer("ada"), Answer(eof=True), Answer(error="no input box"), JobDone(True, ["running", "failed"]),
           KeptCall("release"), KeptAnswer({"rank0": 1 << 30})]


def test_every_message_kind_has_a_sample():
    assert {type(m).__name__ for m in SAMPLES} == set(WIRE)


@pytest.mark.parametrize("body", [b"", b"x" * 10, os.urandom(3 << 20)], ids=["none", "small", "3MiB"])
def test_each_message_crosses_with_its_body(body):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = threading.Thread(target=lambda: [channel.send(ours, m, body) for m in SAMPLES])
        sender.start()
        got = [channel.recv(theirs) for _ in SAMPLES]
        sender.join()
    assert [m for m, _ in got] == SAMPLES
    assert all(b == body for _, b in got)


@pytest.mark.parametrize("header", [b"not json", b'{"kind": "Pickle"}', b'{"kind": "Hello"}',
                                    b'{"kind": "Hello", "token": "t", "pid": 1, "extra": 2}', b"[1, 2]"])
def test_a_frame_that_is_not_ours_is_refused(header):
    with pytest.raises(channel.ProtocolError):
        channel.decode(header)


def test_limits_hold_before_anything_is_read():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel.send(ours, Hello("t", 1), b"pickled things")
        with pytest.raises(channel.ProtocolError, match="over the limit"):
            channel.recv(theirs, channel.HELLO_LIMIT, 0)  # the first frame carries no body
        channel.send(ours, Show("write", ["stdout", "x" * 8192]))
        with pytest.raises(channel.ProtocolError, match="over the limit"):
            channel.recv(theirs, channel.HELLO_LIMIT)
    ours, theirs = socket.socketpair()
    ours.sendall(b"\0\0\0\x10\0\0\0\0{")  # half a frame, then closed
    ours.close()
    with theirs, pytest.raises(EOFError):
        channel.recv(theirs)


def test_the_secret_is_private_random_and_checked_whole(tmp_path):
    token = channel.make_secret(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / SECRET).st_mode) == 0o600
    assert len(token) == 64 and int(token, 16) >= 0 and channel.read_secret(tmp_path) == token
    assert channel.make_secret(tmp_path) != token  # a new job, a new secret
    token = channel.read_secret(tmp_path)
    assert channel.proves(token, token)
    for wrong in (token[:-1], token[:-1] + ("0" if token[-1] != "0" else "1"), "", None, 64, token.upper()):
        assert not channel.proves(token, wrong), wrong


def test_the_socket_is_private_and_found_from_a_long_folder(tmp_path):
    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    assert len(str(folder / SOCKET)) > 108  # too long for AF_UNIX as a path
    listener = channel.listen(folder)
    with listener:
        assert stat.S_IMODE(os.stat(folder / SOCKET).st_mode) == 0o600
        client = channel.connect(folder)
        served, _ = listener.accept()
        with client, served:
            assert channel.peer_uid(served) == os.getuid()
    channel.remove(folder)
    assert not (folder / SOCKET).exists()


@pytest.fixture
def signals():
    """The host sets SIGTERM and SIGINT handlers for its life (it exits after): put them back."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_one_kernel_adopts_at_a_time_and_release_ends_the_host(tmp_path, signals):
    store = Store(tmp_path / "jobs")
    record = make_record("a1b2c3", State.KEPT, keep=True)
    store.create(record)
    host = KeptHost(KeptSession(), store, record, record_sink=None)
    seen: dict = {}

    def kernels():
        try:
            # A wrong secret: refused before anything else, in one line.
            raw = channel.connect(store.folder(record.id))
            channel.send(raw, Hello("0" * 64, 7))
            seen["wrong"] = channel.recv(raw)[0]
            raw.close()
            first = Door(store, record.id, "train.ipynb")
            seen["welcome"] = first.welcome
            with pytest.raises(JobError) as held:
                Door(store, record.id, "other.ipynb")
            seen["held"] = str(held.value)
            seen["lost"] = first.lost()  # nothing to say: they wait for this kernel's cells
            first.close()  # the ranks wait for the next kernel
            second = wait_adopted(store, record.id)
            seen["memory"] = second.call("memory")  # the stand-in's kept ranks have no handle
            seen["answer"] = second.call("release")  # the host ends, saying so
            seen["released"] = second.lost()
        except BaseException as exc:  # shown by the asserts below
            seen["error"] = exc
            host.events.put(("gone", None, None))

    thread = threading.Thread(target=kernels)
    thread.start()
    final = host.serve()  # the main thread, as in the host
    thread.join()
    assert "error" not in seen, seen.get("error")
    assert isinstance(seen["wrong"], Refused) and seen["wrong"].line == (
        "taas: job a1b2c3 refused the connection: wrong secret")
    assert seen["welcome"] == Welcome("a1b2c3", 2, "cpu", "gloo", "k1", None, 1)
    assert seen["lost"] is None and seen["memory"] is None and seen["answer"] is None
    assert seen["held"] == (f"taas: job a1b2c3's kept ranks are held by kernel pid {os.getpid()} (train.ipynb); "
                            "%taas release there (or end that kernel), then attach again")
    assert seen["released"] == "taas: released the kept ranks (2 on cpu/gloo) of job a1b2c3"
    assert final.state is State.DONE and final.ended is not None
    assert not (store.folder(record.id) / SOCKET).exists() and not (store.folder(record.id) / SECRET).exists()


def wait_adopted(store, job_id) -> Door:
    """Adopt once the host has seen the last kernel go (its 'gone' event is served in order)."""
    while True:
        try:
            return Door(store, job_id)
        except JobError as exc:
            if "held by" not in str(exc):
                raise


def test_a_failure_comes_back_as_the_cell_would_raise_it():
    from taas.errors import JobFailed, LaunchError

    interrupt = failure_raised(CellFailed("KeyboardInterrupt: stopped", ["KeyboardInterrupt: stopped", "where"],
                                    "KeyboardInterrupt"))
    assert isinstance(interrupt, KeyboardInterrupt)
    assert interrupt._render_traceback_() == ["KeyboardInterrupt: stopped", "where"]
    failed = failure_raised(CellFailed("ValueError: x", ["Traceback", "ValueError: x"], "JobFailed"))
    assert isinstance(failed, JobFailed) and failed.rendered == ["Traceback", "ValueError: x"]
    refused = failure_raised(CellFailed("--gpus takes a number", [], "DirectiveError"))
    assert isinstance(refused, LaunchError) and str(refused) == "--gpus takes a number"
