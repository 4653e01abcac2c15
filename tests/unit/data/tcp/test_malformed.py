"""Bad input on the TCP transport's channels, from peers that know the job's secret: the hub,
a relay's control connection and a relay's worker streams each ignore (and log) what they
cannot read, and the job's units still arrive."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
import torch

from taas.data.tcp import messages, wire
from taas.data.tcp.endpoint import _Stream, _TcpSender
from taas.data.tcp.relay import Relay
from taas.data.tcp.transport import TcpTransport
from taas.data.transport import LOADING, attach
from tests.support.data import job_shm
from tests.support.data import read_to_end

MiB = 1 << 20


@pytest.fixture
def job(caplog):
    """A transport whose loader 0 has workers 0 and 1 feeding rank 0, and node 0's relay (a
    thread here): (transport, address, relay)."""
    caplog.set_level(logging.WARNING, logger="taas")
    job_id = uuid.uuid4().hex[:12]
    transport = TcpTransport(job_id)
    relay = None
    try:
        address = transport.channels(0, 2, [(0, 0), (1, 0)], 8 * MiB)
        (spec,) = transport.processes({})
        relay = Relay(job_id, 0, transport.hub, spec.args[0]["secret"]).start()
        yield transport, address, relay
    finally:
        if relay is not None:
            relay.close()
        transport.close()
    assert job_shm(job_id) == []


def ignored(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("taas") and "ignored" in r.getMessage() and what in r.getMessage()]


@pytest.mark.parametrize("junk", [b"not json", b"[1, 2]", b'{"op": "where", "node": "x"}',
                                  b'{"op": "query", "loader": 0}'])
def test_the_hub_closes_a_connection_that_opens_with_a_bad_message_and_serves_on(job, caplog, junk):
    transport, address, _ = job
    with wire.connect_auth(transport.hub, transport.secret) as sock:
        sock.sendall(wire._LEN.pack(len(junk)) + junk)
        assert read_to_end(sock) == b""  # nothing answered
    assert ignored(caplog, "data hub")
    # The hub still answers a worker that asks properly.
    with wire.connect_auth(transport.hub, transport.secret) as sock:
        wire.send_message(sock, messages.WhereIs(0))
        assert wire.recv_message(sock, messages.RelayAt) == messages.RelayAt(*transport._where[0])


def test_a_relay_answers_a_query_it_cannot_read_with_an_empty_report(job, caplog):
    transport, _, _ = job
    sock, lock = transport.relays[0]
    with lock:
        for junk in (b"not json", b'{"op": "query", "loader": "zero"}', b'{"op": "relay", "node": 0}'):
            sock.sendall(wire._LEN.pack(len(junk)) + junk)
            assert wire.recv_message(sock, messages.ControlReport) == messages.ControlReport((), {})
    assert len(ignored(caplog, "relay of node 0")) == 3
    state = transport.control(0)  # still in step: the next query gets its own reply
    assert len(state.workers) == 2 and 0 in transport.relays


def test_the_kernel_leaves_out_a_report_it_cannot_read_and_keeps_the_relay(job, caplog):
    transport, _, _ = job
    fake = wire.connect_auth(transport.hub, transport.secret)  # a second node's relay
    replies = [b'{"op": "control", "workers": 5}',
               messages.ControlReport((messages.WorkerReport(LOADING, 4, 1.5, True, 2, 7, False), None), {})]

    def serve() -> None:
        for reply in replies:
            wire.recv_message(fake, messages.Query)
            if isinstance(reply, bytes):
                fake.sendall(wire._LEN.pack(len(reply)) + reply)
            else:
                wire.send_message(fake, reply)

    try:
        wire.send_message(fake, messages.RelayUp(1, "127.0.0.1", 1))
        wire.recv_message(fake, messages.JobLayout)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        first = transport.control(0)
        assert ignored(caplog, "control report of node 1") and 1 in transport.relays
        assert [w.state for w in first.workers] == [0, 0]  # STARTING: nobody reported yet
        second = transport.control(0)
        thread.join(timeout=30)
        assert second.workers[0].state == LOADING and second.workers[0].unit == 4
        assert second.workers[0].prefetched and second.workers[0].produced == 2
    finally:
        fake.close()


def test_a_relay_skips_frames_it_cannot_use_and_still_delivers(job, caplog):
    transport, address, _ = job
    rx = attach(address).receiver(0)
    with wire.connect_auth(transport._where[0], transport.secret) as sock:
        sock.sendall(wire.FRAME.pack(wire.HELLO, 0, 0, 0, 0, 0, 0))  # loader 0, worker 0
        sock.sendall(wire.FRAME.pack(77, 0, 0, 0, 0, 0, 0))  # a kind nobody knows
        sock.sendall(wire.FRAME.pack(wire.CONTROL, 0, 0, 1, 200, 0, 0))  # no such worker state
        sock.sendall(wire.FRAME.pack(wire.END, 1, 5, 0, 0, 0, 0))  # channel 1 is worker 1's
        stream = _Stream(sock)  # as a loader worker's: non-blocking from here on
        assert _TcpSender(stream, 1).put(0, torch.arange(1000))  # a unit, with payload, on channel 1
        sock.sendall(wire.FRAME.pack(wire.END, 9, 5, 0, 0, 0, 0))  # no channel 9 on this node
        assert _TcpSender(stream, 0).put(0, {"x": torch.arange(5), "y": "ok"})  # the real one
        value, _ = rx.take()
        assert torch.equal(value["x"], torch.arange(5)) and value["y"] == "ok"
        assert len(ignored(caplog, "relay of node 0")) == 5, ignored(caplog, "relay")
        # Sizes it cannot trust: the relay ends this stream (where the next frame starts is unknown).
        sock.sendall(wire.FRAME.pack(wire.UNIT, 0, 1, wire.MAX_META + 1, 0, 0, 0))
        assert read_to_end(sock) == b""
        assert ignored(caplog, "cannot trust")
    rx.close()


def test_a_unit_whose_blobs_lie_outside_its_blob_area_ends_the_stream(job, caplog):
    transport, address, _ = job
    rx = attach(address).receiver(0)
    with wire.connect_auth(transport._where[0], transport.secret) as sock:
        sock.sendall(wire.FRAME.pack(wire.HELLO, 0, 0, 0, 0, 0, 0)
                     + wire.FRAME.pack(wire.UNIT, 0, 0, 4, 0, 1, 64) + b"meta" + wire.ENTRY.pack(32, 64))
        assert read_to_end(sock) == b""
    assert ignored(caplog, "cannot trust")
    sender = attach(address)  # a proper worker still gets its units through
    tx = sender.sender(0)
    assert tx.put(0, torch.ones(3))
    assert torch.equal(rx.take()[0], torch.ones(3))
    sender.close()
    rx.close()
