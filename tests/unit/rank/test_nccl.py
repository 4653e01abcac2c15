"""taas.rank.nccl: an NCCL rank's environment, and its stop path (SIGTERM aborts the process
groups, then the rank dies of SIGTERM), tested on CPU through the abort seam in forked children
(signal handlers and wakeup fds must not stay in the test session).  The real NCCL check is
tests/gpu/test_nccl_gpu.py."""

from __future__ import annotations

import ctypes
import os
import signal
import time

from taas.rank import nccl
from tests.support.forks import exit_code, fork, no_leftover_children  # noqa: F401 (an autouse fixture)


def test_an_nccl_rank_gets_async_error_handling_and_its_log_in_the_cell():
    environ = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"}
    nccl.prepare_environment(environ)
    assert environ == {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_a_users_own_async_error_handling_stays():
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    nccl.prepare_environment(environ)
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def _stopped_child(block, tmp_path):
    """Fork a child that installs the stop path (its abort writes a file), then ``block()``s;
    SIGTERM it once it is installed.  (exit code, aborted?, seconds from SIGTERM to exit)."""
    ready, aborted = tmp_path / "ready", tmp_path / "aborted"

    def body() -> int:
        nccl.install_stop(abort=lambda: aborted.touch())
        ready.touch()
        block()
        return 0

    pid = fork(body)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the child never installed its stop path"
        time.sleep(0.01)
    time.sleep(0.1)  # into block()
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    code = exit_code(pid, timeout=10)
    return code, aborted.exists(), time.monotonic() - sent


def test_sigterm_aborts_then_the_rank_dies_of_sigterm(tmp_path):
    code, aborted, _ = _stopped_child(lambda: time.sleep(60), tmp_path)
    assert code == -signal.SIGTERM and aborted


def test_a_main_thread_blocked_in_c_still_aborts_at_once(tmp_path):
    """What a collective's wait looks like: a C call that never returns to Python (a second lock
    of a plain mutex, GIL released by ctypes).  The watcher thread aborts, not the handler."""
    def blocked_in_c() -> None:
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroes: PTHREAD_MUTEX_INITIALIZER on glibc
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # never returns

    code, aborted, seconds = _stopped_child(blocked_in_c, tmp_path)
    assert code == -signal.SIGTERM and aborted
    assert seconds < 5


def test_a_fork_of_the_rank_dies_of_sigterm_alone(tmp_path):
    """A DataLoader worker forked by the rank: its SIGTERM ends it, never the rank's abort."""
    aborted = tmp_path / "aborted"

    def rank() -> int:
        nccl.install_stop(abort=lambda: aborted.touch())
        worker = os.fork()
        if worker == 0:
            time.sleep(60)
            os._exit(0)
        os.kill(worker, signal.SIGTERM)
        _, status = os.waitpid(worker, 0)
        time.sleep(0.3)  # a stray wakeup byte would have reached our watcher by now
        return 0 if os.waitstatus_to_exitcode(status) == -signal.SIGTERM else 2

    assert exit_code(fork(rank)) == 0
    assert not aborted.exists()


def test_an_abort_that_fails_still_ends_the_rank(tmp_path):
    def failing() -> None:
        raise RuntimeError("NCCL says no")

    def body() -> int:
        nccl.install_stop(abort=failing)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return 0

    assert exit_code(fork(body), timeout=10) == -signal.SIGTERM


def test_aborting_without_a_process_group_does_nothing():
    import torch.distributed as dist

    assert not dist.is_initialized()
    nccl.abort_process_groups()


def _setup_sees(backend: str, tmp_path) -> str:
    """Run the rank's ``_setup`` for ``backend`` in a forked child, its process group replaced by
    a recorder: what the environment and the SIGTERM handler were when the group was made."""
    seen = tmp_path / "seen"

    def body() -> int:
        import torch.distributed as dist

        from taas.job.package import Payload
        from taas.rank import main

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        os.environ["NCCL_DEBUG_FILE"] = "/tmp/elsewhere"

        def record(*args, **kwargs) -> None:  # (the rank's patch maps nccl to gloo on CPU)
            handler = signal.getsignal(signal.SIGTERM)
            seen.write_text(" ".join([
                os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "-"),
                os.environ.get("NCCL_DEBUG_FILE", "-"),
                "default" if handler in (signal.SIG_DFL, None) else "taas"]))

        import torch.distributed.distributed_c10d as c10d

        dist.init_process_group = c10d.init_process_group = record  # the rank's patch wraps c10d's
        payload = Payload("", "<cell>", 1, b"", (), device="cpu", backend=backend, pg_timeout=30)
        main._setup(payload)
        return 0

    assert exit_code(fork(body)) == 0
    return seen.read_text()


def test_a_gloo_rank_keeps_todays_behaviour(tmp_path):
    assert _setup_sees("gloo", tmp_path) == "- /tmp/elsewhere default"


def test_an_nccl_rank_is_prepared_before_its_process_group(tmp_path):
    assert _setup_sees("nccl", tmp_path) == "1 - taas"


def test_a_sigterm_during_the_ranks_own_teardown_ends_it_without_an_abort(tmp_path):
    aborted = tmp_path / "aborted"

    def body() -> int:
        nccl.install_stop(abort=lambda: aborted.touch())
        assert nccl.leaving()  # the rank destroys its groups itself from here on
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return 0

    assert exit_code(fork(body), timeout=10) == -signal.SIGTERM
    assert not aborted.exists()


def test_a_rank_leaves_its_groups_to_a_stop_that_came_first(tmp_path):
    def body() -> int:
        nccl.install_stop(abort=lambda: None, die=lambda: None)  # a stop that has not ended us yet
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        return 0 if nccl.leaving() is False else 2

    assert exit_code(fork(body), timeout=10) == 0
