"""The shared-memory ring's waits (taas.data.shm.ring)."""

from __future__ import annotations

import os

from taas.data.shm import ring
from tests.support.highfd import high_pipe


def test_a_wait_takes_a_descriptor_past_1023():
    """A rank of a large job holds many sockets: its ring's wait takes any descriptor number
    (select(2) raised ValueError past 1023)."""
    with high_pipe() as (read, write):
        ring._wait(read, 0.01)  # nothing to read: returns after the timeout
        os.write(write, b"x")
        ring._wait(read, 60)  # readable: returns at once
