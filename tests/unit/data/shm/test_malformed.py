"""Bad input on a shared-memory channel's FIFOs: a rank ignores (and logs) a message its
producer did not send, and a producer never lends one block twice on a repeated FREED."""

from __future__ import annotations

import logging
import os
import uuid

import pytest
import torch

from taas.data.shm import block, segment
from taas.data.shm.ring import ShmReceiver, ShmSender
from taas.data.transport import DATA, PASS_END


@pytest.fixture
def channel(tmp_path, caplog):
    """(sender, receiver, fifos) of one channel, both ends in this process."""
    caplog.set_level(logging.WARNING, logger="taas")
    job = "test" + uuid.uuid4().hex[:8]
    seg = segment.Segment.create(segment.segment_name(job, 0), segment.Layout(1, 1, 8 << 20))
    fifos = segment.make_fifos(str(tmp_path), 0, 0)
    held = [os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in fifos]  # as the kernel does
    tx, rx = ShmSender(seg, 0, fifos), ShmReceiver(seg, 0, fifos)
    yield tx, rx, fifos
    tx.close()
    rx.close()
    for fd in held:
        os.close(fd)
    seg.close()
    segment.unlink_job(job)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"taas-{job}-")]


def ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "taas" and "ignored" in r.getMessage()]


def test_a_rank_ignores_messages_its_producer_did_not_send(channel, caplog):
    tx, rx, fifos = channel
    fd = os.open(fifos[0], os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, block.MSG.pack(42, 0, 0, 0))  # a kind nobody knows
        os.write(fd, block.MSG.pack(DATA, 0, 999, 0))  # a block that does not exist
    finally:
        os.close(fd)
    assert tx.put(0, torch.arange(100_000))  # lent: a block of its own
    header = rx.peek()
    assert header.kind == DATA and header.unit == 0
    value, _ = rx.take()
    assert torch.equal(value, torch.arange(100_000))
    assert len(ignored(caplog)) == 2, ignored(caplog)
    assert tx.end_pass(0, 1) and rx.peek().kind == PASS_END  # the counts stayed in step
    rx.skip()


def test_a_block_whose_header_does_not_fit_it_is_ignored(channel, caplog):
    tx, rx, fifos = channel
    assert tx.put(0, torch.arange(100_000))
    (only,) = tx.blocks.values()
    size = only.size
    block.BLOCK.pack_into(only.mm, 0, size * 2, 64, 10, 0, 128, 256, 0, 0)  # says it is bigger than it is
    assert tx.put(1, torch.arange(100_000, 200_000))  # another block: the first is still lent
    header = rx.peek()
    assert header.unit == 1 and ignored(caplog)
    assert torch.equal(rx.take()[0], torch.arange(100_000, 200_000))


def test_a_producer_lends_a_block_once_however_often_it_is_freed(channel, caplog):
    tx, rx, fifos = channel
    assert tx.put(0, torch.ones(100_000))
    kept, _ = rx.take()  # lent: its block stays out while `kept` lives
    (block_id,) = tx.blocks
    fd = os.open(fifos[1], os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, block.BACK.pack(block.FREED, block_id))  # a FREED before its tensors are garbage
        os.write(fd, block.BACK.pack(block.FREED, block_id))  # and again
        os.write(fd, block.BACK.pack(block.FREED, 12345))  # a block that never was
        os.write(fd, block.BACK.pack(77, 0))  # a kind nobody knows
    finally:
        os.close(fd)
    tx._collect()
    assert [b.id for b in tx.free] == [block_id]  # once, not twice
    assert len(ignored(caplog)) == 3, ignored(caplog)
    del kept  # its own FREED now comes too, and is one too many: ignored
    tx._collect()
    assert [b.id for b in tx.free] == [block_id]
