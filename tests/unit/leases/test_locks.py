"""The lock files with real processes (taas.leases.locks, taas.leases.wait): a lease is held by
every process that has its fds and dies with the last of them, SIGKILL included; a record a
dead process left is never trusted; taking is all or nothing; the line is first come, first
served and a dead waiter leaves it; waiting shows one line and ends when the holder goes;
--no-wait and an interrupt start nothing.  Fake GPU UUIDs: no GPU is needed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from taas.errors import LaunchError
from taas.leases import locks
from taas.leases.api import Holder
from taas.leases.inventory import fake
from taas.leases.wait import acquire, holder_for
from tests.support.forks import exit_code, fork, no_leftover_children  # noqa: F401 (autouse)


@pytest.fixture
def lease_dir(tmp_path):
    path = str(tmp_path / "leases")
    locks.ensure(path)
    return path


def holder(job: str) -> Holder:
    return Holder(job, "tester", 1.0, "nb.ipynb", os.getpid())


def hold_in_child(path: str, uuids: list[str], job: str = "other") -> tuple[int, int]:
    """A child that leases ``uuids`` and then waits for SIGKILL: (its pid, once it holds them)."""
    ready_r, ready_w = os.pipe()

    def body() -> int:
        os.close(ready_r)
        lease = locks.try_take(path, uuids, Holder(job, "someone", 1.0, "", os.getpid()))
        os.write(ready_w, b"1" if lease is not None else b"0")
        signal.pause()
        return 0

    pid = fork(body)
    os.close(ready_w)
    took = os.read(ready_r, 1)  # the event: it holds them (or could not)
    os.close(ready_r)
    assert took == b"1"
    return pid, 0


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert exit_code(pid) == -signal.SIGKILL


def test_the_lock_directory_is_shared_by_every_user_and_its_files_too(lease_dir):
    assert os.stat(lease_dir).st_mode & 0o7777 == 0o1777
    assert os.stat(os.path.join(lease_dir, "queue")).st_mode & 0o7777 == 0o1777
    old = os.umask(0o077)
    try:
        lease = locks.try_take(lease_dir, ["GPU-a"], holder("j"))
    finally:
        os.umask(old)
    assert lease is not None
    assert os.stat(locks.gpu_file(lease_dir, "GPU-a")).st_mode & 0o777 == 0o666
    lease.close()


def test_a_lease_lives_in_every_process_with_its_fds_and_dies_with_the_last(lease_dir):
    lease = locks.try_take(lease_dir, ["GPU-a", "GPU-b"], holder("mine"))
    assert lease is not None and lease.env() == {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    pid = fork(lambda: signal.pause() or 0)  # inherits the fds, as a job's processes do
    lease.close()
    held = locks.held(lease_dir)
    assert set(held) == {"GPU-a", "GPU-b"} and held["GPU-a"].job == "mine"
    assert locks.try_take(lease_dir, ["GPU-a"], holder("late")) is None
    kill(pid)
    assert locks.held(lease_dir) == {}
    again = locks.try_take(lease_dir, ["GPU-b", "GPU-a"], holder("late"))
    assert again is not None
    again.close()


def test_a_killed_holder_leaves_no_lease_and_its_record_is_not_believed(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-a"], job="killed")
    assert locks.held(lease_dir)["GPU-a"].job == "killed"
    kill(pid)
    with open(locks.gpu_file(lease_dir, "GPU-a")) as f:
        assert '"killed"' in f.read()  # the record is still there...
    assert locks.held(lease_dir) == {}  # ...and not believed: its lock went with its holder
    lease = locks.try_take(lease_dir, ["GPU-a"], holder("next"))
    assert lease is not None and locks.held(lease_dir)["GPU-a"].job == "next"
    lease.close()


def test_taking_is_all_or_nothing(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-b"])
    assert locks.try_take(lease_dir, ["GPU-a", "GPU-b", "GPU-c"], holder("greedy")) is None
    assert set(locks.held(lease_dir)) == {"GPU-b"}  # GPU-a was let go, GPU-c never taken
    kill(pid)


def test_the_line_is_first_come_first_served_and_a_killed_waiter_leaves_it(lease_dir):
    ready_r, ready_w = os.pipe()

    def waiter() -> int:
        locks.Place(lease_dir, 2, Holder("first", "someone"))
        os.write(ready_w, b"1")
        signal.pause()
        return 0

    pid = fork(waiter)
    assert os.read(ready_r, 1) == b"1"
    mine = locks.Place(lease_dir, 1, holder("second"))
    line = locks.line(lease_dir)
    assert [(t.holder.job, t.count) for t in line] == [("first", 2), ("second", 1)]
    assert line[1].name == mine.name
    kill(pid)
    assert [t.holder.job for t in locks.line(lease_dir)] == ["second"]
    assert len(os.listdir(os.path.join(lease_dir, "queue"))) == 1  # the dead one's ticket removed
    mine.close()
    assert locks.line(lease_dir) == [] and os.listdir(os.path.join(lease_dir, "queue")) == []


def test_a_waiting_job_shows_one_line_and_takes_the_gpu_when_its_holder_dies(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-a"], job="holder1")
    shown: list[tuple[str, bool]] = []

    def pause(_seconds: float) -> None:  # the holder is killed once the wait line is shown
        if shown and shown[-1][1] is False and pid not in done:
            done.append(pid)
            kill(pid)

    done: list[int] = []
    lease = acquire(1, holder_for("waiter"), lambda: fake("GPU-a"), lambda t, f: shown.append((t, f)),
                    notes.append, path=lease_dir, pause=pause)
    assert lease.uuids == ("GPU-a",)
    text, final = shown[0]
    assert not final and text.startswith("taas: waiting for 1 GPU(s), 0 free: GPU 0 leased by job holder1 (someone")
    assert text.endswith("; 1st in line (interrupt to stop waiting)")
    assert shown[-1][1] is True and shown[-1][0].startswith("taas: waited ")
    assert locks.line(lease_dir) == []  # it left the line
    lease.close()


notes: list[str] = []


def test_no_wait_fails_at_once_with_the_line_and_takes_nothing(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-b"], job="holder2")
    with pytest.raises(LaunchError) as error:
        acquire(2, holder_for("hurried"), lambda: fake("GPU-a,GPU-b"), lambda t, f: None, notes.append,
                no_wait=True, path=lease_dir)
    assert str(error.value).startswith("--no-wait: 2 GPU(s) asked, 1 free: GPU 1 leased by job holder2")
    assert str(error.value).endswith("nothing was started")
    assert set(locks.held(lease_dir)) == {"GPU-b"} and locks.line(lease_dir) == []
    kill(pid)


def test_an_interrupt_stops_waiting_leaves_the_line_and_takes_nothing(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-a"])
    shown: list[tuple[str, bool]] = []

    def pause(_seconds: float) -> None:
        raise KeyboardInterrupt  # Ctrl-C while it waits

    with pytest.raises(KeyboardInterrupt):
        acquire(2, holder_for("impatient"), lambda: fake("GPU-a,GPU-b"), lambda t, f: shown.append((t, f)),
                notes.append, path=lease_dir, pause=pause)
    assert shown[-1] == ("taas: stopped waiting for 2 GPU(s) after 0 s; nothing was started", True)
    assert set(locks.held(lease_dir)) == {"GPU-a"} and locks.line(lease_dir) == []
    kill(pid)


def test_a_gpu_busy_outside_taas_is_said_once_and_not_offered(lease_dir):
    said: list[str] = []
    lease = acquire(1, holder_for("j"), lambda: fake("GPU-a:9000,GPU-b"), lambda t, f: None, said.append,
                    path=lease_dir, busy_mib=1024)
    assert lease.uuids == ("GPU-b",)
    assert said == ["taas: busy outside taas, so not offered to this job: GPU 0 (GPU-a, 8.8 GiB used)"]
    lease.close()


def test_more_gpus_than_offered_is_one_line_not_a_wait(lease_dir):
    with pytest.raises(LaunchError, match=r"^--gpus 3 asks for more GPUs than taas may use here \(2"):
        acquire(3, holder_for("j"), lambda: fake("GPU-a,GPU-b"), lambda t, f: None, notes.append, path=lease_dir)


def test_a_lock_directory_that_is_not_a_directory_is_one_line(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    (tmp_path / "leases").symlink_to(planted)  # someone else's directory, through a symlink
    with pytest.raises(LaunchError, match=r"^cannot use the GPU lease directory .*not a directory\); set TAAS_"):
        acquire(1, holder_for("j"), lambda: fake("GPU-a"), lambda t, f: None, notes.append,
                path=str(tmp_path / "leases"))


def test_the_wait_line_is_redrawn_only_when_it_changes(lease_dir):
    pid, _ = hold_in_child(lease_dir, ["GPU-a"], job="slow")
    shown: list[tuple[str, bool]] = []
    looks: list[int] = []

    def pause(_seconds: float) -> None:
        looks.append(1)
        if len(looks) == 3:  # three looks at the same state, then the holder goes
            kill(pid)

    lease = acquire(1, holder_for("w"), lambda: fake("GPU-a"), lambda t, f: shown.append((t, f)),
                    notes.append, path=lease_dir, pause=pause)
    assert [final for _, final in shown] == [False, True]  # one wait line, then its last state
    lease.close()


def test_first_come_first_served_a_later_smaller_request_does_not_jump_the_line(lease_dir):
    holder_pid, _ = hold_in_child(lease_dir, ["GPU-a"], job="holder")
    said_r, said_w = os.pipe()

    def big() -> int:  # first in line, for both GPUs
        lease = acquire(2, Holder("big", "someone"), lambda: fake("GPU-a,GPU-b"),
                        lambda t, final: os.write(said_w, b"T" if final else b"w"), lambda line: None,
                        path=lease_dir, pause=lambda s: time.sleep(0.01))  # its own polling
        os.write(said_w, b"T")
        signal.pause()
        return 0 if lease else 1

    big_pid = fork(big)
    assert os.read(said_r, 1) == b"w"  # the event: it waits in line
    shown: list[tuple[str, bool]] = []

    def pause(_seconds: float) -> None:
        if holder_pid not in gone:  # we wait behind it although GPU-b is free: the holder goes
            gone.append(holder_pid)
            kill(holder_pid)
            while os.read(said_r, 1) != b"T":  # the event: the first in line took both
                pass
        elif big_pid not in gone:
            gone.append(big_pid)
            kill(big_pid)

    gone: list[int] = []
    lease = acquire(1, holder_for("small"), lambda: fake("GPU-a,GPU-b"), lambda t, f: shown.append((t, f)),
                    notes.append, path=lease_dir, pause=pause)
    assert "1 free: GPU 0 leased by job holder" in shown[0][0] and "; 2nd in line, 1 ahead" in shown[0][0]
    assert any("GPU 0 leased by job big" in t and "GPU 1 leased by job big" in t for t, _ in shown)
    assert lease.uuids == ("GPU-a",) and gone == [holder_pid, big_pid]
    lease.close()


def test_a_draft_ticket_a_killed_waiter_left_is_swept_once_old(lease_dir):
    queue = os.path.join(lease_dir, "queue")
    old, young = os.path.join(queue, ".1-2-ab.draft"), os.path.join(queue, ".3-4-cd.draft")
    for path in (old, young):
        open(path, "w").close()
    os.utime(old, (1.0, 1.0))  # written long ago, and no one holds its lock
    assert locks.line(lease_dir) == []
    assert sorted(os.listdir(queue)) == [".3-4-cd.draft"]  # a young one may be a live waiter's
