"""Processes forked by the data-plane tests (producers, consumers, loader workers, relays).

``fork(body)`` runs ``body()`` in a child whose exit code is what it returns (1 if it raised),
``exit_code(pid)`` waits for it, and the autouse fixture ``no_leftover_children`` (import it
into a test module) kills whatever a failed test left running, so a producer blocked on a full
ring never outlives its test.  ``fork_job_process`` runs a job process (a loader worker, a
relay) the way a launcher starts one: ``entry(spec)`` with the job's directory in the
environment and no events pipe.  ``run_with_events(body)`` runs ``body()`` in a child that has
an events pipe (``TAAS_EVENTS_FD``) as a launched process does, and returns its exit code, the
event lines it sent and what it wrote to stderr: for code that talks to the kernel that way.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest

_forked: list[int] = []


def fork(body: Callable[[], int]) -> int:
    """Fork a child that runs ``body()`` and exits with its result (1 if it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if "torch" in sys.modules:  # the parent's OpenMP pool does not survive fork
                sys.modules["torch"].set_num_threads(1)
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


@dataclass(frozen=True)
class ChildRun:
    """What a child of :func:`run_with_events` did."""

    code: int
    events: list[dict]  # the lines it sent on the events pipe, parsed, in order
    stderr: str


def run_with_events(body: Callable[[], int], timeout: float = 120.0) -> ChildRun:
    """Run ``body()`` in a forked child whose ``TAAS_EVENTS_FD`` is the write end of a pipe this
    process reads (while the child runs: a big line must not block it) and whose ``sys.stderr``
    goes to a file; its exit code, events and stderr once it ended."""
    read_end, write_end = os.pipe()
    with tempfile.NamedTemporaryFile("r", prefix="taas-test-stderr-") as err:
        def child() -> int:
            os.close(read_end)
            os.environ["TAAS_EVENTS_FD"] = str(write_end)
            sys.stderr = open(err.name, "w", buffering=1)
            try:
                return body()
            finally:
                sys.stderr.flush()  # the child ends with os._exit: nothing flushes it later

        pid = fork(child)
        os.close(write_end)
        received: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(read_end, received), daemon=True)
        reader.start()
        code = exit_code(pid, timeout)
        reader.join(timeout)  # EOF: the child's end closed when it exited
        lines = b"".join(received).decode().splitlines()
        return ChildRun(code, [json.loads(line) for line in lines], err.read())


def _read_all(fd: int, into: list[bytes]) -> None:
    try:
        while chunk := os.read(fd, 1 << 16):
            into.append(chunk)
    finally:
        os.close(fd)


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
