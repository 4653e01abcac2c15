"""What one machine can hold, checked before a job starts: one-line refusals, nothing started."""

from __future__ import annotations

import os
import resource

import pytest

from taas.errors import LaunchError
from taas.launch.local import limits, protocol


def test_shared_files_up_to_the_limit_pass():
    limits.check_shared_fds(0)
    limits.check_shared_fds(protocol.MAX_SHARED_FDS)
    with pytest.raises(LaunchError, match=f"at most {protocol.MAX_SHARED_FDS} shared files"):
        limits.check_shared_fds(protocol.MAX_SHARED_FDS + 1)


def test_more_ranks_than_gpus_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(limits, "cuda_device_count", lambda: 2)
    limits.check_gpus(2)
    with pytest.raises(LaunchError) as info:
        limits.check_gpus(3)
    assert "--gpus 3" in str(info.value) and "(2)" in str(info.value) and "\n" not in str(info.value)


def test_the_kernel_needs_a_batch_of_write_ends_while_starting():
    # Three read ends per process, plus at most one batch of write ends at a time.
    assert limits._fds_needed(1) == 6
    many = protocol.FDS_PER_MESSAGE  # more streams than one batch
    assert limits._fds_needed(many) == 3 * many + protocol.FDS_PER_MESSAGE


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))  # as check_fd_limit counts them


@pytest.fixture
def soft_limit():
    """Set the soft open-file limit for a test; the old one comes back after it."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)

    def set_soft(soft: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))

    yield set_soft
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_a_small_job_fits(soft_limit):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _open_files() + limits._fds_needed(2) + limits._FD_MARGIN
    if hard != resource.RLIM_INFINITY and hard < need + 64:
        pytest.skip(f"a hard open-file limit of {hard} leaves no room to try")
    # Under a soft limit with room to spare: it fits as it is, and the limit is left alone.
    soft_limit(need + 32)
    assert limits.check_fd_limit(2) is None
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (need + 32, hard)
    # Under a soft limit a little too low: it fits once the soft limit is raised, to what the
    # job needs (not to the hard limit), and nothing is refused.
    soft_limit(need - 8)
    need = _open_files() + limits._fds_needed(2) + limits._FD_MARGIN
    assert limits.check_fd_limit(2) is None
    soft, after = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert after == hard and need <= soft <= need + 4, (soft, need)


def test_a_job_too_big_for_the_open_file_limit_is_refused_with_what_fits():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(LaunchError) as info:
        limits.check_fd_limit(hard)
    message = str(info.value)
    assert f"a job of {hard} processes" in message and "use at most" in message and "\n" not in message
