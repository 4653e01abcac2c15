"""Leases across users of one machine: a lock directory every user leases GPUs in, and where
no user removes another's files (mode 1777, like /tmp).  Another user is ``setpriv``'s nobody;
needs root (as CI runs)."""

from __future__ import annotations

import subprocess

from taas.leases import locks
from taas.leases.api import Holder
from tests.support.users import needs_another_user, passable_folder, python_as_nobody

OTHER_USER = r"""
import os, sys
from taas.leases import locks
from taas.leases.api import Holder
path = sys.argv[1]
print("root's GPU taken:", locks.try_take(path, ["GPU-a"], Holder("x")) is not None)
print("sees:", locks.held(path)["GPU-a"].job)
lease = locks.try_take(path, ["GPU-b"], Holder("theirs", "nobody"))
print("took GPU-b:", lease is not None)
try:
    os.unlink(locks.gpu_file(path, "GPU-a"))
    print("removed root's file")
except PermissionError:
    print("could not remove root's file")
place = locks.Place(path, 1, Holder("waiting", "nobody"))
print("in line:", ",".join(t.holder.job for t in locks.line(path)), flush=True)
sys.stdin.read()  # holds its lease and its place until root closes our stdin
"""


@needs_another_user
def test_two_users_lease_in_one_directory_and_neither_removes_the_others_files():
    with passable_folder("taas-leases-") as base:  # the lock directory in it is 1777
        path = str(base / "leases")
        locks.ensure(path)
        mine = locks.try_take(path, ["GPU-a"], Holder("rootjob", "root"))
        assert mine is not None
        other = subprocess.Popen(
            python_as_nobody(OTHER_USER, path),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        try:
            assert other.stdout is not None and other.stdin is not None
            lines = [other.stdout.readline().strip() for _ in range(5)]  # the event: it is in line
            assert lines == ["root's GPU taken: False", "sees: rootjob", "took GPU-b: True",
                             "could not remove root's file", "in line: waiting"], \
                (lines, other.stderr.read() if other.poll() is not None else "")
            held = locks.held(path)
            assert held["GPU-b"].job == "theirs" and held["GPU-a"].job == "rootjob"
            assert locks.try_take(path, ["GPU-b"], Holder("late")) is None  # theirs while they live
            assert [t.holder.job for t in locks.line(path)] == ["waiting"]
        finally:
            other.stdin.close()
            assert other.wait(timeout=60) == 0
        assert set(locks.held(path)) == {"GPU-a"} and locks.line(path) == []  # theirs went with them
        again = locks.try_take(path, ["GPU-b"], Holder("rootjob2", "root"))
        assert again is not None  # a file another user created: root leases it (0666)
        again.close()
        mine.close()


NOT_SHARED = r"""
import sys
from taas.errors import LaunchError
from taas.leases.inventory import fake
from taas.leases.wait import acquire, holder_for
try:
    acquire(1, holder_for("j"), lambda: fake("GPU-a"), lambda t, f: None, print, path=sys.argv[1])
except LaunchError as exc:
    print(exc)
"""


@needs_another_user
def test_a_lock_directory_another_user_did_not_share_is_one_line():
    with passable_folder("taas-leases-") as base:
        (base / "leases").mkdir(mode=0o755)  # root's, not 1777: nobody may not lease there
        result = subprocess.run(python_as_nobody(NOT_SHARED, str(base / "leases")),
                                capture_output=True, text=True, cwd="/", timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (
            f"cannot use the GPU lease directory {base / 'leases'} (uid 0's, mode 755, not shared "
            "(1777)); set TAAS_LEASE_DIR to a directory every user of this machine can write")
