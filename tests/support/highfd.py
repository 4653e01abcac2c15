"""A descriptor numbered past 1023 (what select(2) refuses), for the waits that must take one."""

from __future__ import annotations

import contextlib
import os
import resource

import pytest

HIGH = 1500


@contextlib.contextmanager
def high_pipe():
    """A pipe whose read end is numbered HIGH: ``(read, write)``; skips where the open-file limit
    cannot reach it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH:
        pytest.skip(f"the open-file limit ({hard}) cannot reach descriptor {HIGH}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 1), hard))
    read, write = os.pipe()
    try:
        os.dup2(read, HIGH)
        os.close(read)
        yield HIGH, write
    finally:
        os.close(HIGH)
        os.close(write)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
