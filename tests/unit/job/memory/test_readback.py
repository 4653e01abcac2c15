"""The kernel reading rank 0's storages (taas.job.memory.readback): from this process and from
another, and the errors that decide what rank 0 does instead."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys

import pytest
import torch

from taas.job.memory import readback

MIB = 1 << 20


def test_regions_of_a_process_come_back_equal_in_storages_of_their_own():
    a = torch.arange(40 * MIB // 4, dtype=torch.float32)  # more than a segment: both threads
    b = torch.randint(0, 255, (3 * MIB + 5,), dtype=torch.uint8)
    storages = readback.read(os.getpid(), [(a.data_ptr(), a.nbytes), (b.data_ptr(), b.nbytes)])
    assert [s.nbytes() for s in storages] == [a.nbytes, b.nbytes]
    assert torch.equal(torch.empty(0).set_(storages[0]), a)
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(storages[1]), b)
    assert storages[0].data_ptr() != a.data_ptr() and storages[0].resizable()
    assert readback.read(os.getpid(), []) == []


def test_another_process_is_read_while_it_waits():
    child = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, sys\n"
         "buf = ctypes.create_string_buffer(bytes(range(256)) * 8192)\n"
         "print(ctypes.addressof(buf), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = int(child.stdout.readline())
        (storage,) = readback.read(child.pid, [(address, 2 * MIB)])
        assert bytes(torch.empty(0, dtype=torch.uint8).set_(storage)[:512].tolist()) == bytes(range(256)) * 2
    finally:
        child.stdin.close()
        child.wait()
    with pytest.raises(OSError) as gone:  # the process went: an error for this time, not a refusal
        readback.read(child.pid, [(address, MIB)])
    assert not isinstance(gone.value, readback.Unreadable)


def test_memory_that_is_not_there_is_an_error_not_a_refusal():
    with pytest.raises(OSError) as raised:
        readback.read(os.getpid(), [(4096, MIB)])  # nothing is mapped at the first pages
    assert raised.value.errno == errno.EFAULT and not isinstance(raised.value, readback.Unreadable)


def test_no_right_to_read_is_a_refusal(monkeypatch):
    class Refusing:
        @staticmethod
        def process_vm_readv(*args):
            ctypes.set_errno(errno.EPERM)
            return -1

        madvise = staticmethod(lambda *args: 0)

    monkeypatch.setattr(readback, "_libc", Refusing)
    with pytest.raises(readback.Unreadable):
        readback.read(os.getpid(), [(torch.ones(MIB).data_ptr(), MIB)])


def test_new_storages_are_ordinary_torch_memory():
    storage = readback.empty(3 * MIB + 1)
    assert storage.nbytes() == 3 * MIB + 1 and storage.resizable() and not storage.is_shared()
