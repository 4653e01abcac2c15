"""The attempt's rendezvous store (taas.launch.rendezvous.agent_store): on loopback only, and
never a socket closed twice."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import torch.distributed as dist

from taas.launch import rendezvous


def test_the_store_listens_on_loopback_only_and_answers():
    store, port = rendezvous.agent_store(2)
    listening = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"]
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_a_ctrl_c_as_the_store_takes_its_socket_leaves_it_to_the_store(monkeypatch, python_sigint):
    """The store owns the listening socket once made: a Ctrl-C right then raises
    KeyboardInterrupt and the socket is the store's to close, once (closed by us as well, the
    second close would hit whatever file has that number by then)."""
    made, fds = dist.TCPStore, []

    def interrupted(*args, **kwargs):
        store = made(*args, **kwargs)
        fds.append(kwargs["master_listen_fd"])
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the store is made
        return store

    monkeypatch.setattr(dist, "TCPStore", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
        rendezvous.agent_store(2)
    os.fstat(fds[0])  # open still: the store (kept by the traceback) closes it when it goes
    del raised
