"""The TCP transport's loader-worker side (taas.data.tcp.endpoint) against a socket pair or a
fake hub and relays: the frames it writes, what it reads back, and how it finds the relays."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest
import torch

from taas.data.tcp import messages, wire
from taas.data.tcp.endpoint import WHERE_TRIES, TcpEndpoint, _Control, _Stream, _TcpSender
from taas.data.transport import BLOCKED, DONE, LOADING, Address, decode
from tests.support.data import same, structures


@pytest.fixture
def pair():
    """(the worker's stream, the relay's end of the socket)."""
    a, b = socket.socketpair()
    b.settimeout(30)
    stream = _Stream(a)
    yield stream, b
    a.close()
    b.close()


def read_frame(sock: socket.socket) -> tuple:
    return wire.FRAME.unpack(wire.recv_exact(sock, wire.FRAME.size))


def read_unit(sock: socket.socket):
    """A UNIT frame as a relay reads it, decoded: (channel, unit, value)."""
    kind, channel, unit, meta_len, nbuf, nblob, area = read_frame(sock)
    assert kind == wire.UNIT
    meta = wire.recv_exact(sock, meta_len)
    entries = list(wire.ENTRY.iter_unpack(wire.recv_exact(sock, wire.ENTRY.size * (nbuf + nblob))))
    blob_area = bytearray(area)
    for offset, nbytes in entries[nbuf:]:
        blob_area[offset:offset + nbytes] = wire.recv_exact(sock, nbytes)
    buffers = [bytearray(blob_area[o:o + n]) for o, n in entries[:nbuf]]

    def tensor_at(offset, nbytes, dtype, shape, in_place):
        assert not in_place  # nothing is collated in place over TCP
        return torch.frombuffer(bytearray(blob_area[offset:offset + nbytes]), dtype=dtype).view(shape)

    return channel, unit, decode(meta, buffers, tensor_at)


def test_units_go_out_as_frames_a_relay_decodes_equal(pair):
    stream, relay = pair
    sender = _TcpSender(stream, 3)
    values = structures() + [torch.arange(100_000), (torch.zeros(10), np.ones(50_000))]  # big blobs too
    done = []
    thread = threading.Thread(target=lambda: done.extend(read_unit(relay) for _ in values))
    thread.start()  # a reader: the big units do not fit the socket's buffers
    for unit, value in enumerate(values):
        assert sender.put(10 + unit, value)
    thread.join(timeout=60)
    assert [(c, u) for c, u, _ in done] == [(3, 10 + u) for u in range(len(values))]
    for want, (_, _, have) in zip(values, done):
        assert same(want, have), (want, have)
    assert sender.end_pass(2, 99)
    assert read_frame(relay) == (wire.END, 3, 99, 2, 0, 0, 0)
    assert sender.draft() is None  # collated in the worker's own memory


def test_gone_frames_stop_that_channel_only_and_unknown_frames_are_logged(pair, caplog):
    caplog.set_level(logging.WARNING, logger="taas")
    stream, relay = pair
    one, two = _TcpSender(stream, 1), _TcpSender(stream, 2)
    gone = wire.FRAME.pack(wire.GONE, 1, 0, 0, 0, 0, 0)
    relay.sendall(gone[:20])  # a frame in two reads
    assert not one.gone
    relay.sendall(gone[20:] + wire.FRAME.pack(99, 2, 0, 0, 0, 0, 0))
    assert one.gone and not two.gone
    assert not one.put(0, torch.ones(3)) and not one.end_pass(0, 1)  # nothing sent for it
    assert two.put(0, "still")
    assert read_unit(relay)[:2] == (2, 0)
    assert [r for r in caplog.records if "ignored a frame of kind 99" in r.getMessage()]


def test_a_relay_that_went_makes_the_stream_dead(pair):
    stream, relay = pair
    relay.close()
    sender = _TcpSender(stream, 0)
    assert sender.gone and stream.dead
    assert not sender.put(0, torch.ones(3))


def test_control_frames_wait_behind_the_frame_being_written(pair):
    stream, relay = pair
    control = wire.FRAME.pack(wire.CONTROL, 0, 0, 1, LOADING, 5, 2)
    stream.busy = True  # a unit is on its way
    stream.control(control)
    assert stream.pending == control
    stream.busy = False
    assert stream.send([b"x" * wire.FRAME.size])  # the newest state goes first, then the frame
    assert wire.recv_exact(relay, wire.FRAME.size) == control
    assert wire.recv_exact(relay, wire.FRAME.size) == b"x" * wire.FRAME.size
    stream.control(control)  # idle: at once
    assert stream.pending is None and wire.recv_exact(relay, wire.FRAME.size) == control


def test_a_workers_state_goes_to_every_stream_and_done_finishes_them(pair):
    stream, relay = pair
    endpoint = TcpEndpoint.__new__(TcpEndpoint)  # its streams only: no hub here
    endpoint.streams = {0: stream}
    control = _Control(endpoint)
    control.set_state(LOADING, 4)
    assert read_frame(relay) == (wire.CONTROL, 0, 0, 1, LOADING, 4, 0)
    control.produced(3)
    assert read_frame(relay) == (wire.CONTROL, 0, 0, 2, LOADING, 4, 3)
    control.prefetched()
    assert read_frame(relay) == (wire.CONTROL, 0, 0, 3, LOADING | 1 << 8, 4, 3)
    control.set_state(BLOCKED, 6)
    assert read_frame(relay) == (wire.CONTROL, 0, 0, 4, BLOCKED | 1 << 8, 6, 3)
    finished = threading.Thread(target=control.set_state, args=(DONE,))
    finished.start()  # DONE: the last state, then our side shut down; it waits for the relay's end
    assert read_frame(relay) == (wire.CONTROL, 0, 0, 5, DONE | 1 << 8, 0, 3)
    assert relay.recv(1) == b""  # the worker's side is shut
    relay.shutdown(socket.SHUT_WR)
    finished.join(timeout=30)
    assert not finished.is_alive() and stream.finished


class FakeHub:
    """A hub that answers each WhereIs with the next of ``answers`` (bytes: sent as they are),
    and fake relays that authenticate streams and keep their first frame (the HELLO)."""

    def __init__(self, secret: wire.Secret, answers: list):
        self.secret, self.answers, self.asked = secret, list(answers), []
        self.hellos: list[tuple] = []
        self.listener = wire.listen("127.0.0.1")
        self.address = self.listener.getsockname()[:2]
        self.relays = [wire.listen("127.0.0.1") for _ in range(2)]
        self.socks: list[socket.socket] = []
        for target, listener in [(self._hub, self.listener)] + [(self._relay, r) for r in self.relays]:
            threading.Thread(target=target, args=(listener,), daemon=True).start()

    def relay_at(self, node: int) -> messages.RelayAt:
        host, port = self.relays[node].getsockname()[:2]
        return messages.RelayAt(host, port)

    def _hub(self, listener) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with sock:
                if not wire.accept_auth(sock, self.secret, "fake hub"):
                    continue
                self.asked.append(wire.recv_message(sock, messages.WhereIs))
                answer = self.answers.pop(0)
                if isinstance(answer, bytes):
                    sock.sendall(wire._LEN.pack(len(answer)) + answer)
                else:
                    wire.send_message(sock, answer)

    def _relay(self, listener) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            if wire.accept_auth(sock, self.secret, "fake relay"):
                self.socks.append(sock)
                self.hellos.append(wire.FRAME.unpack(wire.recv_exact(sock, wire.FRAME.size)))

    def close(self) -> None:
        for sock in [self.listener, *self.relays, *self.socks]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()
            except OSError:  # not connected
                pass
            sock.close()


def endpoint_for(hub: FakeHub, pairs, ranks_per_node) -> TcpEndpoint:
    return TcpEndpoint(Address("taas.data.tcp.endpoint:TcpEndpoint", {
        "job": "j", "loader": 2, "hub": hub.address, "secret": hub.secret, "pairs": pairs,
        "ranks_per_node": ranks_per_node}))


def test_a_worker_opens_a_stream_to_every_gpu_node_of_its_loader(caplog):
    caplog.set_level(logging.WARNING, logger="taas")
    secret = wire.Secret()
    hub = FakeHub(secret, [])
    hub.answers = [b"not json", hub.relay_at(0), hub.relay_at(1)]  # one unreadable answer: asked again
    try:
        endpoint = endpoint_for(hub, [(0, 0), (1, 1), (0, 2)], 2)  # ranks 0, 1 on node 0; rank 2 on node 1
        endpoint.worker(1)  # worker 1 feeds rank 1 only, yet every node waits for its first slice
        assert hub.asked == [messages.WhereIs(0), messages.WhereIs(0), messages.WhereIs(1)]
        assert sorted(endpoint.streams) == [0, 1]
        deadline = time.monotonic() + 30
        while len(hub.hellos) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hub.hellos == [(wire.HELLO, 0, 0, 2, 1, 0, 0)] * 2  # loader 2, worker 1
        assert [r for r in caplog.records if "ignored an answer of the data hub" in r.getMessage()]
        endpoint.control.set_state(LOADING, 0)  # the hub is not asked again: streams are kept
        assert len(hub.asked) == 3
        for stream in endpoint.streams.values():
            stream.close()
    finally:
        hub.close()


def test_a_hub_that_never_answers_readably_is_a_connection_error():
    secret = wire.Secret()
    hub = FakeHub(secret, [b"[1, 2]"] * WHERE_TRIES)
    try:
        endpoint = endpoint_for(hub, [(0, 0)], None)
        with pytest.raises(ConnectionError, match="never said where node 0's relay is"):
            endpoint.sender(0)
        assert len(hub.asked) == WHERE_TRIES
    finally:
        hub.close()


def test_a_hub_without_the_secret_is_refused():
    hub = FakeHub(wire.Secret(), [])
    hub.answers = [hub.relay_at(0)]
    try:
        endpoint = TcpEndpoint(Address("taas.data.tcp.endpoint:TcpEndpoint", {
            "job": "j", "loader": 0, "hub": hub.address, "secret": wire.Secret(), "pairs": [(0, 0)],
            "ranks_per_node": None}))
        with pytest.raises((wire.Refused, EOFError, OSError)):
            endpoint.sender(0)
    finally:
        hub.close()


def test_the_transports_waits_take_a_descriptor_past_1023():
    """select(2) raised ValueError past descriptor 1023 (a rank of a large job holds many)."""
    import os

    from taas.data.tcp import wire
    from tests.support.highfd import high_pipe

    with high_pipe() as (read, write):
        assert wire.ready(read, timeout=0.01) == {}
        os.write(write, b"x")
        assert read in wire.ready(read, timeout=60)
