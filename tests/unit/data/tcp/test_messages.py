"""The hub's messages (TCP transport) are typed: each reads back equal, and anything else is a
BadMessage -- never a KeyError or AttributeError in the thread that reads it."""

from __future__ import annotations

import json
import socket

import pytest

from taas.data.tcp import messages as m
from taas.data.tcp import wire

EVERY = [
    m.RelayUp(node=1, host="127.0.0.1", port=4000),
    m.WhereIs(node=0),
    m.RelayAt(host="127.0.0.1", port=4001),
    m.JobLayout({0: m.LoaderLayout(2, ((0, 0), (1, 1)), 1 << 20), 3: m.LoaderLayout(1, ((0, 1),), 10)}, (0, 1)),
    m.JobLayout({}, 2),
    m.JobLayout({}, None),
    m.Query(loader=2),
    m.ControlReport((m.WorkerReport(1, 7, 0.5, True, 3, 9, False), None), {1: (7, 2.5)}),
    m.ControlReport((), {}),
]

MALFORMED = [
    5,
    [1, 2],
    "query",
    None,
    {},
    {"op": "nope"},
    {"op": "query"},
    {"op": "query", "loader": "0"},
    {"op": "query", "loader": -1},
    {"op": "query", "loader": 1.0},
    {"op": "where", "node": None},
    {"op": "relay", "node": 0, "host": 5, "port": 1},
    {"op": "at", "host": "h"},
    {"op": "layout", "loaders": [], "ranks_per_node": None},
    {"op": "layout", "loaders": {"x": {"workers": 1, "pairs": [], "bound": 1}}, "ranks_per_node": None},
    {"op": "layout", "loaders": {"0": {"workers": 1, "pairs": [[0]], "bound": 1}}, "ranks_per_node": None},
    {"op": "layout", "loaders": {}, "ranks_per_node": "2"},
    {"op": "control", "workers": [[1, 2, 3]], "wanted": {}},
    {"op": "control", "workers": [[1, 7, -0.5, True, 3, 9, False]], "wanted": {}},
    {"op": "control", "workers": [], "wanted": {"0": [1]}},
    {"op": "control", "workers": 5, "wanted": {}},
]


@pytest.mark.parametrize("message", EVERY, ids=lambda x: type(x).__name__)
def test_every_message_reads_back_equal_through_json(message):
    data = json.loads(json.dumps(m.encode(message)))
    assert m.decode(data) == message
    assert m.decode(data, type(message)) == message


@pytest.mark.parametrize("data", MALFORMED, ids=repr)
def test_anything_else_is_a_bad_message(data):
    with pytest.raises(m.BadMessage):
        m.decode(data)


def test_a_message_of_another_type_than_expected_is_a_bad_message():
    with pytest.raises(m.BadMessage, match="unexpected"):
        m.decode(m.encode(m.Query(0)), m.RelayUp, m.WhereIs)


def test_bytes_that_are_not_json_are_a_bad_message_and_the_next_message_still_reads():
    a, b = socket.socketpair()
    with a, b:
        for junk in (b"not json", b"\xff\xfe", b'{"op": "query"'):
            a.sendall(wire._LEN.pack(len(junk)) + junk)
        wire.send_message(a, m.Query(4))
        for _ in range(3):
            with pytest.raises(m.BadMessage):
                wire.recv_message(b)
        assert wire.recv_message(b, m.Query) == m.Query(4)
        a.sendall(wire._LEN.pack(wire.MAX_MESSAGE + 1))  # a length it will not read: the stream ends
        with pytest.raises(EOFError):
            wire.recv_message(b)
