"""Rank 0's big result storages come back as memory files on the job's results channel
(taas.job.memory.returns): both ends in one process, through results.collect and results.load."""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch

from taas.job import results
from taas.job.memory import returns
from taas.job.memory.bigvalues import BigValues
from taas.job.memory.resident import ResidentMemory
from taas.job.memory.returns import Batch, ResultChannel, Returns

MIB = 1 << 20
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


def trip(namespace, bound, channel, out=None, to_cpu=True) -> tuple[results.Results, results.CellResult]:
    sent = results.collect(namespace, bound, out, to_cpu=to_cpu, channel=channel.rank_end())
    return sent, results.load(results.decode(results.encode(sent)), channel)


def test_big_tensors_come_back_equal_as_shared_storages_without_a_file_left(channel):
    big = torch.arange(4 * N, dtype=torch.float32)
    namespace = {"big": big, "view": big[10:20], "small": torch.ones(3), "n": 7}
    sent, got = trip(namespace, ("big", "view", "small", "n"), channel, out=big)
    assert sent.shared is not None and sent.shared_count == 1  # one storage, one file
    assert all(len(blob) < 4096 for blob in sent.values.values())  # no GiB in the pickles
    assert got.notes == () and got.values["n"] == 7
    back = got.values["big"]
    assert torch.equal(back, big) and torch.equal(got.values["view"], big[10:20])
    storage = back.untyped_storage()
    assert storage.is_shared() and not storage.resizable()  # as torch.multiprocessing gives it
    # views of one storage on rank 0 are views of one storage here, across names and Out[]
    assert got.values["view"].untyped_storage().data_ptr() == storage.data_ptr()
    assert got.out.untyped_storage().data_ptr() == storage.data_ptr()
    assert not got.values["small"].untyped_storage().is_shared()  # small ones stay inline
    back.add_(1)  # an ordinary tensor: in place, numpy, saving
    assert back.numpy()[0] == 1.0 and float(got.values["view"][0]) == 11.0
    assert memfds() == ["/memfd:taas-result (deleted)"]  # the storage's own fd, nothing else
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("taas-") and "result" in n]


def test_the_file_goes_with_the_last_tensor_over_it(channel):
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


def test_a_failed_job_leaves_nothing_the_kernel_never_takes_the_files(channel):
    sent = results.collect({"big": torch.ones(4 * N)}, ("big",), None, to_cpu=True, channel=channel.rank_end())
    assert sent.shared_count == 1
    assert memfds() == []  # rank 0's own fds closed once sent; the file is only in flight
    channel.close()  # what the session does after a failed job: the queued file goes with it
    assert memfds() == [] and result_maps() == 0


def test_files_of_another_attempt_are_closed_and_the_right_ones_taken(channel):
    results.collect({"big": torch.ones(2 * N)}, ("big",), None, to_cpu=True, channel=channel.rank_end())
    sent, got = trip({"big": torch.full((2 * N,), 3.0)}, ("big",), channel)  # the attempt that succeeded
    assert float(got.values["big"][0]) == 3.0
    assert len(memfds()) == 1  # the first attempt's file was closed
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


def test_a_device_storage_is_copied_once_into_its_file():
    ch = ResultChannel()
    try:
        sender = Returns(ch.rank_end())
        storage = torch.arange(N, dtype=torch.float32).untyped_storage()
        reduced = sender.copy_in(storage)  # (the CUDA path; the copy works from any device)
        assert reduced[0] is returns._map_result and sender.written == MIB
        assert sender.copy_in(torch.ones(8).untyped_storage()) is None  # small: inline
        sender.send()
        fds = ch.take(sender.token, 1)
        with returns.mapping(fds):
            back = reduced[0](*reduced[1])
        for fd in fds:
            os.close(fd)
    finally:
        ch.close()
    assert torch.equal(torch.empty(0).set_(back), torch.arange(N, dtype=torch.float32))


def test_a_result_goes_out_again_by_descriptor_without_a_copy(channel, tmp_path):
    """The next job reading a tensor that came back passes its file's fd (bigvalues' resident
    path), since the storage keeps it."""
    sent, got = trip({"big": torch.ones(2 * N)}, ("big",), channel)
    resident = ResidentMemory(str(tmp_path))
    out = BigValues("testjob", directory=str(tmp_path), resident=resident)  # as the session makes it
    try:
        reduced = out.reduce(got.values["big"].untyped_storage())
        assert isinstance(reduced[1][0], int) and out.written == 0 and os.listdir(tmp_path) == []
    finally:
        out.unlink()
        resident.close()


def test_junk_on_the_channel_is_closed_and_ignored(channel):
    junk = socket.socket(fileno=os.dup(channel.rank_end()))
    r, w = os.pipe()
    try:
        junk.sendmsg([b"not a batch"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, r.to_bytes(4, "little"))])
        junk.sendmsg([Batch(b"x" * 16, 0).pack()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, w.to_bytes(4, "little"))])
    finally:
        junk.close()
        os.close(r)
        os.close(w)
    assert channel.take(b"y" * 16, 0) == []
    assert channel.take(b"y" * 16, 1) is None


def test_channel_from_the_environment():
    assert returns.channel_from({}) is None
    assert returns.channel_from({"TAAS_RESULT_CHANNEL": "1", "TAAS_SHARED_FDS": "5,9"}) == 9
    assert returns.channel_from({"TAAS_RESULT_CHANNEL": "2", "TAAS_SHARED_FDS": "5,9"}) is None
    assert Batch.unpack(Batch(b"t" * 16, 3).pack()) == Batch(b"t" * 16, 3)
    assert Batch.unpack(b"short") is None


def test_a_storage_that_cannot_get_its_file_goes_inline(channel, monkeypatch):
    def refuse(nbytes):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(returns, "_memfd", refuse)
    sent, got = trip({"big": torch.full((2 * N,), 4.0)}, ("big",), channel)
    assert sent.shared is None and got.notes == ()
    assert torch.equal(got.values["big"], torch.full((2 * N,), 4.0))
