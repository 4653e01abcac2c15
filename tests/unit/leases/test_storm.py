"""Never two holders of one GPU, in any interleaving: several processes take, use, let go,
are interrupted while they wait and are SIGKILLed while they wait or hold, at random, over four
fake GPUs; each process marks the GPUs it holds while it holds them, and a mark found on a
GPU it just leased whose owner still lives is two holders at once.  Bounded: it runs until
the processes leased GPUs some 60 times (a second or two of CPU here)."""

from __future__ import annotations

import os
import random
import signal
import time

from taas.leases import locks
from taas.leases.api import Holder
from taas.leases.inventory import fake
from taas.leases.wait import acquire
from tests.support.forks import exit_code, fork, no_leftover_children  # noqa: F401 (autouse)
from tests.support.processes import wait_for

GPUS = "GPU-0,GPU-1,GPU-2,GPU-3"
TAKES = 60


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _owner(mark: str) -> int | None:
    try:
        with open(mark) as f:
            return int(f.read() or "0")
    except FileNotFoundError:
        return None


def _claim(marks: str, uuids, violations: str) -> list[str]:
    """Mark ``uuids`` as ours.  A holder removes its mark before it lets go of the lease, so a
    mark found here is either a SIGKILLed holder's (it never removes it: fine once that process
    has ended) or a live holder's: two holders of one GPU, the violation."""
    mine = []
    for uuid in uuids:
        mark = os.path.join(marks, uuid)
        try:
            fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = _owner(mark)
            # Wait for an event: its owner's end (killed: its lock went as it died), or its
            # owner letting go of the mark while alive (it still held the GPU we leased).
            ended = other is not None and wait_for(
                lambda other=other, mark=mark: "dead" if _dead(other) else (
                    "let go" if _owner(mark) != other else None),
                timeout=60.0, poll=0.002) == "dead"
            if not ended:
                with open(violations, "a") as f:
                    f.write(f"{uuid}: {os.getpid()} leased it while {other} held it\n")
            tmp = f"{mark}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, mark)
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        mine.append(mark)
    return mine


def _worker(path: str, marks: str, violations: str, stop: str, seed: int) -> int:
    rng = random.Random(seed)
    inventory = lambda: fake(GPUS)  # noqa: E731

    def pause(_seconds: float) -> None:
        if os.path.exists(stop) or rng.random() < 0.05:
            raise KeyboardInterrupt  # an interrupt while it waits
        time.sleep(0.003)

    while not os.path.exists(stop):
        try:
            lease = acquire(rng.randint(1, 3), Holder(f"w{seed}", "t", 0.0, "", os.getpid()), inventory,
                            lambda t, f: None, lambda line: None, path=path, pause=pause)
        except KeyboardInterrupt:
            continue
        mine = _claim(marks, lease.uuids, violations)
        with open(os.path.join(marks, "takes"), "a") as f:
            f.write("x")
        time.sleep(rng.random() * 0.005)  # "training"
        if rng.random() < 0.1:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank that crashes while it holds the GPUs
        for mark in mine:
            if _owner(mark) == os.getpid():  # (after a violation it may be another's)
                os.unlink(mark)
        lease.close()
    return 0


def test_no_gpu_ever_has_two_holders_whatever_starts_is_interrupted_or_killed(tmp_path):
    path, marks = str(tmp_path / "leases"), str(tmp_path / "marks")
    os.mkdir(marks)
    violations, stop = str(tmp_path / "violations"), str(tmp_path / "stop")
    locks.ensure(path)
    takes = os.path.join(marks, "takes")
    rng = random.Random(1234)
    seeds = iter(range(10_000))

    def start() -> int:
        seed = next(seeds)
        return fork(lambda: _worker(path, marks, violations, stop, seed))

    workers = [start() for _ in range(4)]
    last = 0
    while (done := os.path.getsize(takes) if os.path.exists(takes) else 0) < TAKES:
        if done > last:  # a take happened: now and then, SIGKILL a worker wherever it is
            last = done
            if rng.random() < 0.3:
                victim = workers.pop(rng.randrange(len(workers)))
                os.kill(victim, signal.SIGKILL)
                exit_code(victim)
                workers.append(start())
        for pid in list(workers):  # those that killed themselves holding GPUs: replaced
            if os.waitpid(pid, os.WNOHANG)[0]:
                from tests.support import forks

                forks._forked.remove(pid)
                workers.remove(pid)
                workers.append(start())
        time.sleep(0.01)
    open(stop, "w").close()
    for pid in workers:
        exit_code(pid, timeout=60)
    assert not os.path.exists(violations), open(violations).read()
    # Nothing a killed holder or waiter left is believed: every GPU free, no one in line, and
    # a job asking for all four takes them at once.
    assert locks.held(path) == {} and locks.line(path) == []
    shown: list[str] = []
    lease = acquire(4, Holder("last"), lambda: fake(GPUS), lambda t, f: shown.append(t), lambda line: None,
                    path=path)
    assert lease.uuids == tuple(GPUS.split(",")) and shown == []
    lease.close()
