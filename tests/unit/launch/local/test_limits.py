"""What one machine can hold, checked before a job starts: one-line refusals, nothing started."""

from __future__ import annotations

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


def test_a_small_job_fits():
    limits.check_fd_limit(2)


def test_a_job_too_big_for_the_open_file_limit_is_refused_with_what_fits():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(LaunchError) as info:
        limits.check_fd_limit(hard)
    message = str(info.value)
    assert f"a job of {hard} processes" in message and "use at most" in message and "\n" not in message
