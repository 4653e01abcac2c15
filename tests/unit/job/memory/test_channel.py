"""The results channel's wire (taas.job.memory.channel): its three messages as data, and rank
0's side of the exchange against a bare socket standing for the kernel."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from taas.job.memory import channel as wire
from taas.job.memory.channel import Answer, Files, Regions


def test_each_message_comes_back_as_it_went():
    for message in (Files(b"t" * 16, 3), Answer(b"a" * 16, wire.UNREADABLE),
                    Regions(b"r" * 16, 256, 300, ((1 << 47, 1 << 30), (4096, 1 << 20))),
                    Regions(b"r" * 16, 0, 0, ())):
        assert wire.unpack(message.pack()) == message


@pytest.mark.parametrize("junk", [b"", b"short", b"\x01" + b"x" * 5, b"\x02" + b"x" * 30, b"\x09" * 21,
                                  Regions(b"r" * 16, 0, 1, ((1, 2),)).pack()[:-3]])
def test_anything_else_is_not_a_message(junk):
    assert wire.unpack(junk) is None


def test_channel_from_the_environment():
    assert wire.channel_from({}) is None
    assert wire.channel_from({"TAAS_RESULT_CHANNEL": "1", "TAAS_SHARED_FDS": "5,9"}) == 9
    assert wire.channel_from({"TAAS_RESULT_CHANNEL": "2", "TAAS_SHARED_FDS": "5,9"}) is None


@pytest.fixture
def pair():
    kernel, rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield kernel, rank
    for end in (kernel, rank):
        if end.fileno() >= 0:
            end.close()


def kernel_that(kernel: socket.socket, answer) -> threading.Thread:
    """A kernel end that reads every Regions message of one request, then does ``answer``."""
    def serve():
        asked = []
        while True:
            message = wire.unpack(kernel.recv(1 << 16))
            asked.extend(message.regions)
            if len(asked) == message.total:
                answer(message, asked)
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("status", [wire.READ, wire.FAILED, wire.UNREADABLE])
def test_rank_0_waits_for_the_answer_to_its_own_token(pair, monkeypatch, status):
    monkeypatch.setattr(wire, "_unreadable", False)
    kernel, rank = pair
    regions = [(4096 * i, 1 << 20) for i in range(600)]  # three messages

    def answer(message, asked):
        assert asked == regions
        kernel.send(Answer(b"o" * 16, wire.READ).pack())  # another request's: not this one's
        kernel.send(b"junk")
        kernel.send(Answer(message.token, status).pack())

    thread = kernel_that(kernel, answer)
    assert wire.ask_to_read(rank.fileno(), b"m" * 16, regions) is (status == wire.READ)
    thread.join()
    assert wire._unreadable is (status == wire.UNREADABLE)
    if status == wire.UNREADABLE:  # never asks again: files at once
        assert wire.ask_to_read(rank.fileno(), b"n" * 16, regions) is False


def test_rank_0_waiting_sees_the_kernel_go(pair, monkeypatch):
    monkeypatch.setattr(wire, "_unreadable", False)
    kernel, rank = pair
    thread = kernel_that(kernel, lambda message, asked: kernel.close())
    with pytest.raises(OSError, match="closed the results channel"):
        wire.ask_to_read(rank.fileno(), b"m" * 16, [(4096, 1 << 20)])
    thread.join()


def test_files_go_in_batches_under_their_token(pair):
    kernel, rank = pair
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(wire.MAX_FDS_PER_BATCH + 5)]
    try:
        wire.send_files(rank.fileno(), b"f" * 16, fds)
        got = []
        for _ in range(2):
            data, fd_list, _, _ = socket.recv_fds(kernel, 64, wire.MAX_FDS_PER_BATCH)
            got.append((wire.unpack(data), len(fd_list)))
            for fd in fd_list:
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
    assert got == [(Files(b"f" * 16, 0), wire.MAX_FDS_PER_BATCH), (Files(b"f" * 16, wire.MAX_FDS_PER_BATCH), 5)]


def test_the_kernel_answers_a_request_it_cannot_make_whole_with_failed_not_a_refusal():
    ch = wire.ResultChannel()
    rank = socket.socket(fileno=os.dup(ch.rank_end()))
    try:  # regions 1 and 2 of 2: region 0 never came
        rank.send(Regions(b"q" * 16, 1, 2, ((4096, 1 << 20), (8192, 1 << 20))).pack())
        assert wire.unpack(rank.recv(64)) == Answer(b"q" * 16, wire.FAILED)
        assert ch.readable and ch._read == {}
    finally:
        rank.close()
        ch.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_ctrl_c_as_the_channel_closes_still_closes_all_four_descriptors(python_sigint):
    """Closing is one step: an interrupt fuzz's Ctrl-Cs, landing as the serving thread was
    joined, left the channel marked closed with its socketpair and pipe open (four descriptors
    per cell; closing again did nothing)."""
    import signal

    before = _open_fds()
    ch = wire.ResultChannel()
    join = ch._thread.join

    def interrupted(*args):
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the thread is joined
        join(*args)

    ch._thread.join = interrupted
    with pytest.raises(KeyboardInterrupt):
        ch.close()
    ch.close()  # what a later clean-up would do
    assert _open_fds() == before
    assert not ch._thread.is_alive()
