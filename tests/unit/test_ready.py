"""taas.ready: the poll(2) every wait on a descriptor goes through, with real pipes and sockets."""

from __future__ import annotations

import os
import socket
import threading

from taas import ready
from tests.support.highfd import high_pipe


def test_only_what_can_be_read_is_readable_in_the_order_given():
    r1, w1 = os.pipe()
    a, b = socket.socketpair()
    try:
        assert ready.readable([r1, a], 0) == []  # nothing written: a look, no wait
        os.write(w1, b"x")
        b.send(b"y")
        assert ready.readable([a, r1], 0) == [a, r1]  # the socket object itself comes back
        os.read(r1, 1)
        assert ready.readable([r1, a], 0) == [a]
    finally:
        for fd in (r1, w1):
            os.close(fd)
        a.close()
        b.close()


def test_a_closed_peer_reads_as_its_end():
    a, b = socket.socketpair()
    b.close()
    try:
        assert ready.readable([a], None) == [a]  # no timeout: it would wait for ever otherwise
        assert a.recv(1) == b""
    finally:
        a.close()


def test_a_wait_ends_when_a_write_comes():
    r, w = os.pipe()
    try:
        writer = threading.Timer(0.05, os.write, (w, b"x"))
        writer.start()
        assert ready.wait_readable(r, None) & ready.IN
        writer.join()
    finally:
        os.close(r)
        os.close(w)


def test_the_time_running_out_is_zero_events_and_a_closed_descriptor_says_so():
    r, w = os.pipe()
    os.close(w)
    os.close(r)  # its number is no open file now
    assert ready.wait_readable(r, 0) & ready.CLOSED
    r, w = os.pipe()
    try:
        assert ready.wait_readable(r, 0.001) == 0
    finally:
        os.close(r)
        os.close(w)


def test_writable_and_readable_at_once():
    a, b = socket.socketpair()
    try:
        events = ready.poll([(a, ready.IN | ready.OUT), (b, ready.IN)], 0)
        assert events == {a.fileno(): ready.OUT}  # room to write, nothing to read
    finally:
        a.close()
        b.close()


def test_a_descriptor_past_1023_is_waited_on_like_any_other():
    with high_pipe() as (read, write):
        os.write(write, b"x")
        assert ready.readable([read], 1.0) == [read]
        assert ready.wait_readable(read, 1.0) & ready.IN
