"""The shared-memory transport with real processes: a forked producer, this process consumes."""

from __future__ import annotations

import gc
import os
import time
import uuid

import numpy as np
import pytest
import torch

from taas.data.shm import segment, ring as shm
from taas.data.transport import DATA, PASS_END
from tests.support.data import Point, same, structures
from tests.support.forks import exit_code, fork, no_leftover_children  # noqa: F401 (an autouse fixture)


@pytest.fixture
def channel(tmp_path):
    """(segment, fifos, job id) for one channel; everything of the job unlinked afterwards."""
    job = "test" + uuid.uuid4().hex[:8]
    made = []

    held = []

    def make(bound=1 << 20):
        seg = segment.Segment.create(segment.segment_name(job, 0), segment.Layout(1, 1, bound))
        made.append(seg)
        fifos = segment.make_fifos(str(tmp_path), 0, 0)
        held.extend(os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in fifos)  # as the kernel does
        return seg, fifos

    yield make
    for fd in held:
        os.close(fd)
    for seg in made:
        seg.close()
    segment.unlink_job(job)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"taas-{job}-")]


def produce(seg_name, fifos, values, pass_end=None):
    """Fork a producer that puts ``values`` as units 0.. and exits 0 (3 if a put failed)."""
    def body() -> int:
        gc.disable()  # units must be freed by reference counting alone: no cycles
        seg = segment.Segment.attach(seg_name)
        tx = shm.ShmSender(seg, 0, fifos)
        ok = all(tx.put(u, v) for u, v in enumerate(values))
        if ok and pass_end is not None:
            ok = tx.end_pass(0, pass_end)
        return 0 if ok else 3
    return fork(body)


def test_structures_arrive_equal_with_tensors_outside_pickle(channel):
    seg, fifos = channel()
    values = structures()
    pid = produce(seg.name, fifos, values, pass_end=len(values))
    rx = shm.ShmReceiver(seg, 0, fifos)
    got = []
    for u in range(len(values)):
        header = rx.peek()
        assert header.kind == DATA and header.unit == u
        value, nbytes = rx.take()
        got.append(value)
    header = rx.peek()
    assert header.kind == PASS_END and header.unit == len(values) and header.aux == 0
    rx.skip()
    assert exit_code(pid) == 0
    for want, have in zip(values, got):
        assert same(want, have), (want, have)
    # Tensors view the producer's blocks: nothing of them went through pickle.
    assert got[0][0].untyped_storage().nbytes() == 48
    rx.close()


def test_units_wait_for_a_consumer_that_comes_after_the_producer_left(channel):
    seg, fifos = channel()
    pid = produce(seg.name, fifos, [torch.arange(5), "two"], pass_end=2)
    assert exit_code(pid) == 0
    rx = shm.ShmReceiver(seg, 0, fifos)
    assert torch.equal(rx.take()[0], torch.arange(5)) and rx.take()[0] == "two"
    assert rx.peek().kind == PASS_END
    rx.close()


def test_backpressure_bounds_bytes_in_flight(channel):
    bound = 1 << 20
    seg, fifos = channel(bound)
    unit = torch.ones(64 * 1024)  # 256 KiB
    pid = produce(seg.name, fifos, [unit] * 40)
    deadline = time.monotonic() + 10
    while not seg.channel(0, segment.C_WAITING) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seg.channel(0, segment.C_WAITING) == 1, "the producer should wait for space"
    time.sleep(0.2)
    in_flight = seg.channel(0, segment.C_SENT_BYTES) - seg.channel(0, segment.C_TAKEN_BYTES)
    assert 0 < in_flight <= bound
    assert seg.channel(0, segment.C_UNITS) <= 4
    rx = shm.ShmReceiver(seg, 0, fifos)
    gc.disable()
    try:
        for u in range(40):
            assert rx.peek().unit == u
            value, _ = rx.take()
            assert torch.equal(value, unit)
            del value
    finally:
        gc.enable()
    assert exit_code(pid) == 0
    # Units dropped as they came: a handful of blocks served all 40.
    assert len([n for n in os.listdir("/dev/shm") if n.startswith(seg.name + "-")]) <= 6
    rx.close()


def test_a_rank_that_keeps_every_unit_does_not_block_the_channel(channel):
    seg, fifos = channel(1 << 20)
    pid = produce(seg.name, fifos, [torch.full((64 * 1024,), float(u)) for u in range(30)])
    rx = shm.ShmReceiver(seg, 0, fifos)
    kept = [rx.take()[0] for _ in range(30)]
    assert exit_code(pid) == 0
    assert all(torch.equal(t, torch.full((64 * 1024,), float(u))) for u, t in enumerate(kept))
    rx.close()


def test_blocks_are_reused_only_after_their_tensors_are_garbage(channel):
    seg, fifos = channel(1 << 20)
    pid = produce(seg.name, fifos, [(torch.full((20_000,), float(u)),) for u in range(200)])  # 80 kB: lent
    rx = shm.ShmReceiver(seg, 0, fifos)
    views = {}
    for u in range(200):
        (t,), _ = rx.take()
        if u % 50 == 0:
            views[u] = t[10:20]  # a view keeps its block
        del t
        gc.collect() if u % 20 == 0 else None
    assert exit_code(pid) == 0
    for u, v in views.items():
        assert torch.equal(v, torch.full((10,), float(u)))
    rx.close()


def test_a_closed_consumer_releases_a_waiting_producer(channel):
    seg, fifos = channel(1 << 20)
    pid = produce(seg.name, fifos, [torch.ones(200_000)] * 20)
    rx = shm.ShmReceiver(seg, 0, fifos)
    rx.take()
    deadline = time.monotonic() + 10
    while not seg.channel(0, segment.C_WAITING) and time.monotonic() < deadline:
        time.sleep(0.01)
    rx.close()
    assert exit_code(pid, timeout=5) == 3  # put() returned False: the consumer has gone


def test_a_dead_consumer_releases_a_waiting_producer(channel):
    seg, fifos = channel(1 << 20)
    pid = produce(seg.name, fifos, [torch.ones(200_000)] * 20)
    def consumer_body() -> int:
        shm.ShmReceiver(segment.Segment.attach(seg.name), 0, fifos)
        time.sleep(0.3)
        return 0
    consumer = fork(consumer_body)
    assert exit_code(consumer) == 0
    assert exit_code(pid, timeout=5) == 3


def test_units_collated_in_place_arrive_equal_and_are_not_copied(channel):
    from torch.utils.data import default_collate

    from taas.data import source
    from taas.data.transport import encode

    seg, fifos = channel(8 << 20)
    tx = shm.ShmSender(seg, 0, fifos)
    rx = shm.ShmReceiver(seg, 0, fifos)

    def batch(u):  # growing batches: each draft (sized like the last unit) is outgrown once
        return [{"x": torch.full((3, 4), float(i)), "y": i, "n": np.array([i, 2 * i]), "s": f"s{i}",
                 "p": Point(torch.tensor([i]), i / 2)} for i in range(u + 1 + (u == 3) * 40)]

    for u in range(6):
        draft = tx.draft()
        assert (draft is None) == (u == 0)
        value = source.collate_into(batch(u), draft.alloc) if draft else default_collate(batch(u))
        if draft is not None and u != 4:  # stacked tensors are in the block already: not copied
            in_block = (draft.block.address, draft.block.size)
            copied = {t.data_ptr() for _, _, t in encode(value, in_block).blobs}
            for t in (value["x"], value["n"], value["p"][0]):
                assert 0 <= t.data_ptr() - in_block[0] < in_block[1] and t.data_ptr() not in copied
        assert tx.put(u, value, draft)
        got, _ = rx.take()
        assert same(got, default_collate(batch(u))), u
    rx.close()


def test_small_units_are_copied_so_keeping_them_pins_no_block(channel):
    seg, fifos = channel(1 << 20)
    tx = shm.ShmSender(seg, 0, fifos)
    rx = shm.ShmReceiver(seg, 0, fifos)
    kept = []
    for u in range(300):
        assert tx.put(u, (torch.tensor([u, u]), torch.zeros(1000, 100)[u % 2: u % 2 + 1]))
        kept.append(rx.take()[0])
    assert len(tx.blocks) <= 2  # every small unit's block came back at once
    assert all(torch.equal(k[0], torch.tensor([u, u])) for u, k in enumerate(kept))
    big = torch.arange(100_000.0)  # 400 kB: lent, not copied
    assert tx.put(300, big)
    lent, _ = rx.take()
    block = max(tx.blocks)  # the newest block holds it
    tx._collect()
    assert torch.equal(lent, big) and block not in {b.id for b in tx.free}
    del lent
    gc.collect()
    tx._collect()
    assert block in {b.id for b in tx.free}  # back in the pool once its tensor is garbage
    rx.close()
