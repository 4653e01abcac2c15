"""An attempt's clean-up frees its own resources and never the next attempt's.

Attempt ids are ``<job>`` then ``<job>-1`` (:func:`taas.launch.api.attempt_id`), so every name of
attempt ``<job>-1`` starts with ``taas-<job>-``; the start process runs attempt ``<job>``'s hook
after its processes ended, when the next attempt may have made its segments already.  The
hooks run here in another process, as the launcher runs them."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import torch

from taas.data.shm import segment
from taas.data.tcp.nodes import fifo_directory, header_name, remove_node
from taas.data.transport import attach, resolve
from taas.launch.api import attempt_id
from tests.support.data import run_hook

SHM = "taas.data.shm.transport:ShmTransport"
MiB = 1 << 20


@pytest.mark.parametrize("name, ours", [
    ("taas-J-0", True),
    ("taas-J-12", True),
    ("taas-J-0-c3-b17", True),
    ("taas-J-1-0", False),  # attempt J-1's header of loader 0
    ("taas-J-1-0-c0-b0", False),  # and a block of it
    ("taas-J-1-c0-b0", True),  # attempt J's loader 1, block 0 of channel 0
    ("taas-J-value0", False),  # the job's big values (taas.job.memory.bigvalues)
    ("taas-J-n0-0", False),  # a relay's header (taas.data.tcp.relay)
    ("taas-J-0-c0", False),
    ("taas-J-0-c0-b0-x", False),
    ("taas-J-", False),
    ("taas-JJ-0", False),
])
def test_an_attempts_names_are_matched_whole(name, ours):
    assert bool(segment.names_of("J").fullmatch(name)) is ours


@pytest.mark.parametrize("name, node, ours", [
    ("taas-J-n0-0", 0, True),
    ("taas-J-n0-1-c2-b3", 0, True),
    ("taas-J-n1-0", 0, False),
    ("taas-J-n10-0", 1, False),
    ("taas-J-1-n0-0", 0, False),  # attempt J-1's relay on node 0
    ("taas-J-0", 0, False),
])
def test_a_relays_names_are_matched_whole(name, node, ours):
    assert bool(segment.names_of("J", f"-n{node}").fullmatch(name)) is ours


def _shm_names(prefix: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _fill(transport, loaders: int = 2):
    """Each loader's channels, with blocks the producer made (a lent unit, not yet freed)."""
    out = []
    for loader in range(loaders):
        endpoint = attach(transport.channels(loader, 1, [(0, 0)], 8 * MiB))
        tx, rx = endpoint.sender(0), endpoint.receiver(0)
        assert tx.put(0, torch.full((100_000,), float(loader)))
        out.append((tx, rx))
    return out


def test_the_shm_hook_leaves_the_next_attempt_and_the_big_values_alone():
    job = uuid.uuid4().hex[:12]
    first, second = resolve(SHM)(attempt_id(job, 0)), resolve(SHM)(attempt_id(job, 1))
    big = f"/dev/shm/taas-{job}-value0"
    channels = []
    try:
        channels += _fill(first)
        channels += _fill(second)
        with open(big, "wb") as f:
            f.write(b"a big value")
        # (By prefix, taas-<job>-1- is ambiguous: attempt <job>'s loader 1 starts with it too.)
        theirs = {n for n in _shm_names(f"taas-{job}-") if segment.names_of(attempt_id(job, 1)).fullmatch(n)}
        assert segment.segment_name(attempt_id(job, 1), 0) in theirs and len(theirs) >= 4  # headers, blocks
        ours = {n for n in _shm_names(f"taas-{job}-") if segment.names_of(job).fullmatch(n)}
        assert len(ours) >= 4 and not ours & theirs
        run_hook(first.cleanup())  # late: the next attempt has made everything of its own
        assert _shm_names(f"taas-{job}-") == theirs | {os.path.basename(big)}
        assert not os.path.exists(first.directory) and os.path.isdir(second.directory)
        first.close()  # the kernel's own close, as idempotent and as careful
        assert _shm_names(f"taas-{job}-") == theirs | {os.path.basename(big)}
        tx, rx = channels[2]  # the next attempt's channels still carry units
        value, _ = rx.take()
        assert torch.equal(value, torch.zeros(100_000))
        assert tx.put(1, torch.arange(5)) and torch.equal(rx.take()[0], torch.arange(5))
    finally:
        for tx, rx in channels:
            tx.close()
            rx.close()
        first.close()
        second.close()
        if os.path.exists(big):
            os.unlink(big)
    assert _shm_names(f"taas-{job}-") == set()


def test_the_tcp_hook_and_a_relays_removal_leave_the_next_attempt_alone():
    from taas.data.tcp.transport import cleanup

    job = uuid.uuid4().hex[:12]
    made = []
    try:
        for attempt in (attempt_id(job, 0), attempt_id(job, 1)):
            for node in (0, 1):
                for loader in (0, 1):
                    name = header_name(attempt, node, loader)
                    segment.Segment.create(name, segment.Layout(1, 1, MiB)).close()
                    segment.Segment.create(segment.block_name(name, 0, 0), segment.Layout(1, 1, MiB)).close()
                os.makedirs(fifo_directory(attempt, node))
                made.append(tempfile.mkdtemp(prefix=os.path.basename(fifo_directory(attempt, node)) + "-new-"))
        theirs = _shm_names(f"taas-{job}-1-")  # attempt <job>'s relay names start with taas-<job>-n
        assert len(theirs) == 8
        remove_node(job, 1)  # a relay of attempt <job> ends on node 1
        assert {n for n in _shm_names(f"taas-{job}-") - theirs} == {
            header_name(job, 0, 0), header_name(job, 0, 1),
            segment.block_name(header_name(job, 0, 0), 0, 0), segment.block_name(header_name(job, 0, 1), 0, 0)}
        assert not os.path.exists(fifo_directory(job, 1)) and not os.path.exists(made[1])
        run_hook(("taas.data.tcp.transport:cleanup", (job, None)))  # the kernel's machine: every node
        assert _shm_names(f"taas-{job}-") == theirs
        assert not os.path.exists(fifo_directory(job, 0)) and not os.path.exists(made[0])
        assert all(os.path.isdir(fifo_directory(attempt_id(job, 1), node)) for node in (0, 1))
        assert all(os.path.isdir(path) for path in made[2:])
    finally:
        cleanup(attempt_id(job, 1))
        cleanup(job)
    assert _shm_names(f"taas-{job}-") == set()
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"taas-{job}-")]
