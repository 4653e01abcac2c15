"""Processes forked by the data-plane tests (producers, consumers, loader workers, relays).

``fork(body)`` runs ``body()`` in a child whose exit code is what it returns (1 if it raised),
``exit_code(pid)`` waits for it, and the autouse fixture ``no_leftover_children`` (import it
into a test module) kills whatever a failed test left running, so a producer blocked on a full
ring never outlives its test.  ``fork_job_process`` runs a job process (a loader worker, a
relay) the way a launcher starts one: ``entry(spec)`` with the job's directory in the
environment and no events pipe.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import pytest

_forked: list[int] = []


def fork(body: Callable[[], int]) -> int:
    """Fork a child that runs ``body()`` and exits with its result (1 if it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            code = body()
        finally:
            os._exit(code)
    _forked.append(pid)
    return pid


def fork_job_process(entry: Callable, spec, job_dir: str) -> int:
    """A job process as a launcher runs one: ``entry(spec)``, TAAS_JOB_DIR set."""
    def body() -> int:
        os.environ["TAAS_JOB_DIR"] = job_dir
        os.environ.pop("TAAS_EVENTS_FD", None)
        return entry(spec)
    return fork(body)


def exit_code(pid: int, timeout: float = 120.0) -> int:
    """The child's exit code once it ended; killed and AssertionError if it runs past
    ``timeout`` (a bound for a child that hangs, not a measure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _forked.remove(pid)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    _forked.remove(pid)
    raise AssertionError(f"forked process {pid} did not finish in {timeout} s")


@pytest.fixture(autouse=True)
def no_leftover_children():
    """A failed test must not leave a child of ours running."""
    yield
    while _forked:
        pid = _forked.pop()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
