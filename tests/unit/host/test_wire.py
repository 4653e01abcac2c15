"""The host's side of its frames (taas.host.wire): what a job shows goes to the kernel whole."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from taas.host import channel
from taas.host.api import Show
from taas.host.wire import WireSink


def test_a_ctrl_c_while_a_big_frame_goes_out_sends_it_whole():
    """The host's main thread is interrupted while a frame is half sent (the kernel reads
    slowly): the frame still goes whole, then the interrupt is raised; a frame cut short would
    leave the kernel's stream out of step (every later frame unreadable)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the host
    host, kernel = socket.socketpair()
    kernel.settimeout(10)
    main = threading.main_thread().ident
    body = b"y" * (8 << 20)  # far more than the socket holds: the send blocks part way
    got: list = []

    def read_slowly():
        kernel.recv(1, socket.MSG_PEEK)  # the frame has begun
        time.sleep(0.1)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)
        got.append(channel.recv(kernel))

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            WireSink(host, True).send(Show("write", ["stdout", "x"]), body)
    finally:
        signal.signal(signal.SIGINT, previous)
    reader.join(15)
    assert got and got[0][0] == Show("write", ["stdout", "x"]) and got[0][1] == body
    host.close()
    kernel.close()
