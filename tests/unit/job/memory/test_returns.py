"""Rank 0's big result storages come back on the job's results channel (taas.job.memory.returns):
read out of rank 0's memory by the kernel, or as memory files where it may not read it.  Both
ends in one process, through results.collect and results.load; the last test has rank 0 in a
process of its own."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys

import pytest
import torch

from taas.job import results
from taas.job.memory import channel as wire
from taas.job.memory import readback, returns
from taas.job.memory.bigvalues import BigValues
from taas.job.memory.channel import Files, ResultChannel
from taas.job.memory.resident import ResidentMemory
from taas.job.memory.returns import Returns
from tests.support.heap import mmapped_floats

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
N = MIB // 4  # float32 elements in 1 MiB: the threshold


def memfds() -> list[str]:
    """This process's open result files (memfds named taas-result)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:taas-result" in target:
            found.append(target)
    return found


def result_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:taas-result" in line for line in f)


@pytest.fixture
def channel():
    ch = ResultChannel()
    yield ch
    ch.close()
    gc.collect()


@pytest.fixture
def unreadable(monkeypatch):
    """A kernel that may not read rank 0's memory (Yama, seccomp): rank 0 sends files."""
    def refuse(pid, regions):
        raise readback.Unreadable(1, "Operation not permitted")

    monkeypatch.setattr(readback, "read", refuse)
    monkeypatch.setattr(wire, "_unreadable", False)
    yield
    wire._unreadable = False


def trip(namespace, bound, channel, out=None, to_cpu=True) -> tuple[results.Results, results.CellResult]:
    sent = results.collect(namespace, bound, out, to_cpu=to_cpu, channel=channel.rank_end())
    return sent, results.load(results.decode(results.encode(sent)), channel)


def test_big_tensors_come_back_equal_read_from_rank_0_as_ordinary_storages(channel):
    big = torch.arange(4 * N, dtype=torch.float32)
    namespace = {"big": big, "view": big[10:20], "small": torch.ones(3), "n": 7}
    sent, got = trip(namespace, ("big", "view", "small", "n"), channel, out=big)
    assert sent.shared is not None and sent.shared_count == 1  # one storage
    assert all(len(blob) < 4096 for blob in sent.values.values())  # no MiB in the pickles
    assert got.notes == () and got.values["n"] == 7
    assert got.big == "1 storage, 0.00 GiB, read from rank 0's memory"
    back = got.values["big"]
    assert torch.equal(back, big) and torch.equal(got.values["view"], big[10:20])
    storage = back.untyped_storage()
    assert storage.data_ptr() != big.untyped_storage().data_ptr()  # the kernel's own copy
    assert not storage.is_shared() and storage.resizable()  # an ordinary torch allocation
    # views of one storage on rank 0 are views of one storage here, across names and Out[]
    assert got.values["view"].untyped_storage().data_ptr() == storage.data_ptr()
    assert got.out.untyped_storage().data_ptr() == storage.data_ptr()
    back.add_(1)  # an ordinary tensor: in place, resizing, numpy
    back.resize_(8 * N)
    assert back.numpy()[0] == 1.0 and float(got.values["view"][0]) == 11.0 and big[0] == 0.0
    assert memfds() == [] and not [n for n in os.listdir("/dev/shm") if n.startswith("taas-") and "result" in n]


def test_big_tensors_come_back_as_shared_files_where_the_kernel_may_not_read(channel, unreadable):
    big = torch.arange(4 * N, dtype=torch.float32)
    namespace = {"big": big, "view": big[10:20], "small": torch.ones(3)}
    sent, got = trip(namespace, ("big", "view", "small"), channel, out=big)
    assert sent.shared_count == 1 and got.notes == ()
    assert got.big == "1 storage, 0.00 GiB, as memory files"
    back = got.values["big"]
    storage = back.untyped_storage()
    assert torch.equal(back, big) and storage.is_shared() and not storage.resizable()
    assert got.values["view"].untyped_storage().data_ptr() == storage.data_ptr()
    assert got.out.untyped_storage().data_ptr() == storage.data_ptr()
    assert not got.values["small"].untyped_storage().is_shared()  # small ones stay inline
    assert memfds() == ["/memfd:taas-result (deleted)"]  # the storage's own fd, nothing else
    assert wire._unreadable and not channel.readable  # neither end asks again
    sent, again = trip({"big": torch.ones(2 * N)}, ("big",), channel)
    assert again.big.endswith("as memory files")


def test_a_read_that_fails_this_time_sends_files_this_time_only(channel, monkeypatch):
    real = readback.read
    monkeypatch.setattr(readback, "read", lambda pid, regions: (_ for _ in ()).throw(OSError(12, "no memory")))
    sent, got = trip({"big": torch.full((2 * N,), 2.0)}, ("big",), channel)
    assert got.big.endswith("as memory files") and float(got.values["big"][0]) == 2.0
    monkeypatch.setattr(readback, "read", real)
    sent, got = trip({"big": torch.full((2 * N,), 5.0)}, ("big",), channel)
    assert got.big.endswith("read from rank 0's memory") and float(got.values["big"][0]) == 5.0


def test_the_file_goes_with_the_last_tensor_over_it(channel, unreadable):
    before = len(memfds())
    sent, got = trip({"big": torch.ones(2 * N)}, ("big",), channel)
    assert len(memfds()) == before + 1 and result_maps() >= 1
    del got
    gc.collect()
    assert len(memfds()) == before and result_maps() == 0


def test_a_module_comes_back_with_tied_weights_and_gradients_usable(channel):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    model[1].weight = torch.nn.Parameter(model[0].weight.t())  # tied: one storage
    sent, got = trip({"model": model}, ("model",), channel)
    back = got.values["model"]
    assert sent.shared_count == 1  # the two 2 MiB weights share one storage: one file
    assert torch.equal(back[0].weight, model[0].weight) and torch.equal(back[0].bias, model[0].bias)
    assert back[1].weight.untyped_storage().data_ptr() == back[0].weight.untyped_storage().data_ptr()
    loss = back(torch.randn(4, 512)).sum()
    loss.backward()
    torch.optim.SGD(back.parameters(), lr=0.1).step()
    assert back[0].weight.grad is not None


def test_a_failed_job_leaves_nothing_the_kernel_never_takes_what_was_read(channel):
    sent = results.collect({"big": torch.ones(4 * N)}, ("big",), None, to_cpu=True, channel=channel.rank_end())
    assert sent.shared_count == 1 and len(channel._read) == 1  # read while rank 0 waited
    channel.close()  # what the session does after a failed job: what was read goes with it
    assert channel._read == {}


def test_a_failed_job_leaves_nothing_the_kernel_never_takes_the_files(channel, unreadable):
    gc.collect()
    before, maps = len(memfds()), result_maps()
    sent = results.collect({"big": torch.ones(4 * N)}, ("big",), None, to_cpu=True, channel=channel.rank_end())
    assert sent.shared_count == 1
    assert len(memfds()) <= before + 1  # rank 0's own fds closed once sent; in flight, or held by the channel
    channel.close()  # what the session does after a failed job: the file goes with it
    assert len(memfds()) == before and result_maps() == maps


@pytest.mark.parametrize("files", [False, True], ids=["read", "files"])
def test_what_another_attempt_sent_is_dropped_and_the_right_one_taken(channel, monkeypatch, files):
    if files:
        monkeypatch.setattr(readback, "read", lambda pid, regions: (_ for _ in ()).throw(OSError(12, "")))
    results.collect({"big": torch.ones(2 * N)}, ("big",), None, to_cpu=True, channel=channel.rank_end())
    sent, got = trip({"big": torch.full((2 * N,), 3.0)}, ("big",), channel)  # the attempt that succeeded
    assert float(got.values["big"][0]) == 3.0
    assert len(memfds()) == files and channel._read == {}  # the first attempt's went
    del got


def test_when_the_files_do_not_arrive_the_value_is_a_note():
    ch = ResultChannel()
    try:
        sent = results.collect({"big": torch.ones(2 * N), "ok": 1}, ("big", "ok"), None, to_cpu=True,
                               channel=ch.rank_end())
        got = results.load(sent, None)  # no channel in the kernel
    finally:
        ch.close()
    assert got.values == {"ok": 1}
    assert got.notes == ("taas: `big` was not brought back: RuntimeError: its shared memory from rank 0 "
                         "did not arrive",)


def test_a_channel_that_refuses_means_everything_travels_inline():
    ch = ResultChannel()
    rank_end = os.dup(ch.rank_end())
    ch.close()  # the kernel's end is gone: sendmsg fails
    try:
        sent = results.collect({"big": torch.ones(2 * N)}, ("big",), None, to_cpu=True, channel=rank_end)
    finally:
        os.close(rank_end)
    assert sent.shared is None and sent.shared_count == 0
    got = results.load(sent)
    assert torch.equal(got.values["big"], torch.ones(2 * N)) and memfds() == []


def test_a_device_storage_is_copied_once_into_host_memory_the_kernel_reads():
    ch = ResultChannel()
    try:
        sender = Returns(ch.rank_end())
        storage = torch.arange(N, dtype=torch.float32).untyped_storage()
        reduced = sender.copy_in(storage)  # (the CUDA path; the copy works from any device)
        assert reduced[0] is returns._map_result and sender.written == MIB
        assert sender.held[0].data_ptr() != storage.data_ptr()  # rank 0's host copy
        assert sender.copy_in(torch.ones(8).untyped_storage()) is None  # small: inline
        sender.send()
        taken = ch.take(sender.token, 1)
        with returns.mapping(taken):
            back = reduced[0](*reduced[1])
    finally:
        ch.close()
    assert torch.equal(torch.empty(0).set_(back), torch.arange(N, dtype=torch.float32))


@pytest.mark.parametrize("files", [False, True], ids=["read", "files"])
def test_a_result_goes_out_again_by_descriptor(channel, tmp_path, monkeypatch, files):
    """The next job reading a tensor that came back passes a descriptor (bigvalues' resident
    path): a read one is moved to shared memory in place, as any notebook tensor; one that came
    as a file keeps that file's fd (no copy at all)."""
    if files:
        monkeypatch.setattr(readback, "read", lambda pid, regions: (_ for _ in ()).throw(OSError(12, "")))
    n = mmapped_floats()  # the kernel's copy must be a mapping of its own to be moved
    sent, got = trip({"big": torch.ones(n)}, ("big",), channel)
    resident = ResidentMemory(str(tmp_path))
    out = BigValues("testjob", directory=str(tmp_path), resident=resident)  # as the session makes it
    try:
        reduced = out.reduce(got.values["big"].untyped_storage())
        assert isinstance(reduced[1][0], int) and os.listdir(tmp_path) == []  # a descriptor
        resident.settle()
        assert resident.moved == out.written == (0 if files else n * 4 + PAGE)  # glibc's chunk
        assert torch.equal(got.values["big"], torch.ones(n))
    finally:
        out.unlink()
        resident.close()


def test_junk_on_the_channel_is_closed_and_ignored(channel):
    junk = socket.socket(fileno=os.dup(channel.rank_end()))
    r, w = os.pipe()
    try:
        junk.sendmsg([b"not a batch"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, r.to_bytes(4, "little"))])
        junk.sendmsg([Files(b"x" * 16, 0).pack()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, w.to_bytes(4, "little"))])
    finally:
        junk.close()
        os.close(r)
        os.close(w)
    assert channel.take(b"y" * 16, 0) == []
    assert channel.take(b"y" * 16, 1) is None
    assert channel._files == {} and channel._read == {}


def test_a_storage_that_cannot_get_its_file_goes_inline(channel, unreadable, monkeypatch):
    def refuse(nbytes):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(returns, "_memfd", refuse)
    sent, got = trip({"big": torch.full((2 * N,), 4.0)}, ("big",), channel)
    assert sent.shared is None and got.notes == ()
    assert torch.equal(got.values["big"], torch.full((2 * N,), 4.0))


RANK_0 = """
import os, sys, torch
from taas.job import results
big = torch.arange(3 * (1 << 18), dtype=torch.float32)
net = torch.nn.Linear(512, 1024)
sent = results.collect({"big": big, "net": net}, ("big", "net"), None, to_cpu=True,
                       channel=int(sys.argv[1]))
big.zero_()  # once collect returned, rank 0's memory may change: the kernel has its copy
sys.stdout.buffer.write(results.encode(sent))
"""


def test_rank_0_in_a_process_of_its_own_is_read_and_may_go_on_at_once(channel):
    """The kernel reads another process's memory (the pid the socket vouches for) while that
    process waits; the process goes on (here: overwrites the tensor, exits) once answered."""
    rank_end = channel.rank_end()
    done = subprocess.run([sys.executable, "-c", RANK_0, str(rank_end)], pass_fds=(rank_end,),
                          capture_output=True, check=True, timeout=120)
    got = results.load(results.decode(done.stdout), channel)
    assert got.notes == () and got.big == "2 storages, 0.00 GiB, read from rank 0's memory"
    assert torch.equal(got.values["big"], torch.arange(3 * (1 << 18), dtype=torch.float32))
    assert got.values["net"].weight.shape == (1024, 512)
