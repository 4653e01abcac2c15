"""Registered loaders on kept ranks (--keep) through a real kernel: each kept cell that reads a
loader gets loader workers of its own and every unit once, on the same rank processes; the
workers, their shared memory and the ranks' views of it end with the cell; a loader failure is
shown as in a one-cell job and the kept ranks stay.

Each test releases its kept ranks, so that ``clean`` finds nothing but the warm start process.
Those marked ``on_both_launchers`` also run on the second launcher (tests/support/private_launcher.py):
a kept job and each cell's loader job side by side, watched as one through ``JobHandle.fileno``."""

from __future__ import annotations

import json
import os
import re
import signal

import psutil
import pytest

from tests.support import ranks
from tests.support.kernel_driver import (cell, plain, process_name, shm_entries, wait_for,
                                         wait_until_gone)
from tests.support.kept import loader_failure_cell, ok
from tests.support.launchers import kernel_on, on_both_launchers

pytestmark = pytest.mark.kernel

SETUP = """
import os, time
import torch
import taas
from torch.utils.data import DataLoader, Dataset

class Own(Dataset):
    '''Each sample is its own index; sample `fail` raises (how='raise') or kills its worker,
    once a file per rank is in `after` (the ranks are in the cell's code).'''
    def __init__(self, n, fail=None, how=None, after=None):
        self.n, self.fail, self.how, self.after = n, fail, how, after
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == self.fail:
            for _ in range(3000):
                if self.after is None or len(os.listdir(self.after)) >= 2:
                    break
                time.sleep(0.01)
            if self.how == "raise":
                raise ValueError(f"sample {i} is corrupt")
            os.kill(os.getpid(), 9)
        return torch.tensor(i)

loader = DataLoader(Own(22), batch_size=4, shuffle=True)   # 6 batches a pass
taas.register(loader)
"""

# Every rank prints its pid and, per pass, the indices it got.
PASSES = """
import os, json
got = [[i for b in loader for i in b.tolist()] for _ in range({passes})]
print("LOG", json.dumps([os.getpid(), got]))
"""


@pytest.fixture(scope="module")
def kernel(kernel):
    """The module's kernel on its launcher (tests/conftest.py's) with SETUP run in it once:
    pytest sets this up again when the launcher changes, and may come back to a kernel."""
    if kernel.run("'Own' in dir()").result != "True":
        run = kernel.run(cell(SETUP))
        assert run.error is None, run.traceback
    return kernel


def _logs(run) -> dict[int, list]:
    out = {}
    for line in ranks.per_rank(run.stdout).splitlines():
        match = re.match(r"\[rank(\d+)\] LOG (.*)", line)
        if match:
            out[int(match.group(1))] = json.loads(match.group(2))
    return out


def _ranks(kernel) -> list[psutil.Process]:
    return sorted((p for p in kernel.descendants() if process_name(p).startswith("taas-rank")),
                  key=lambda p: p.pid)


def _loader_workers(kernel) -> list[int]:
    return [p.pid for p in kernel.descendants() if process_name(p).startswith("taas-loader")]


def _data_maps(pid: int) -> list[str]:
    """The data plane's shared memory a process still maps (headers and blocks)."""
    with open(f"/proc/{pid}/maps") as f:
        return re.findall(r"/dev/shm/(taas-[0-9a-f]{12}-\d+\S*)", f.read())


@on_both_launchers
def test_kept_cells_each_get_every_unit_once_from_loader_workers_of_their_own(kernel, clean):
    shm_before = shm_entries()
    try:
        first = ok(kernel.run("%%taas --gpus 2 --cpus 2 --keep\n" + cell(PASSES.format(passes=1))))
        pids = [p.pid for p in _ranks(kernel)]
        fds = None
        for i in range(4):  # the same loader again and again, on the same ranks
            run = first if i == 0 else ok(kernel.run("%%taas --cpus 2 --units 12\n" + cell(PASSES.format(passes=2))))
            logs = _logs(run)
            assert sorted(logs) == [0, 1], run.stdout
            assert sorted(pid for pid, _ in logs.values()) == pids  # the kept rank processes
            passes = len(logs[0][1])
            for p in range(passes):  # every unit once per pass, a pass split between the ranks
                assert sorted(i for r in (0, 1) for i in logs[r][1][p]) == list(range(22)), logs
            units = 6 * passes
            summary = [line for line in run.stdout.splitlines() if "units delivered" in line]
            delivered = f"{units}/{units} units delivered to 2 ranks by 2 workers"
            assert len(summary) == 1 and delivered in summary[0], run.stdout
            shown = " ".join(str(data.get("text/plain", "")) for _, data in run.displays)
            assert f"/{units} units ready" in shown, shown
            # The cell's loader workers and its shared memory end with it; the ranks stay and
            # hold nothing of it (their views are released).
            assert wait_until_gone(_loader_workers(kernel)) == []
            wait_for(lambda: all(not _data_maps(pid) for pid in pids), timeout=10,
                     what="the ranks' views released")
            assert [p.pid for p in _ranks(kernel)] == pids
            now = [p.num_fds() for p in _ranks(kernel)]
            if i >= 2:  # after the first cells (imports done): nothing grows per cell
                assert fds is not None and all(b <= a for a, b in zip(fds, now)), (fds, now)
            fds = now
        # A kept cell without the loader, and one whose leftover view is spent.
        assert ok(kernel.run("%%taas\nlen(got[0]) > 0")).result == "True"
        spent = kernel.run("%%taas\nfor b in globals()['loader']:\n    pass")
        assert spent.error is not None and "from an earlier cell" in plain(spent.traceback)
        assert [p.pid for p in _ranks(kernel)] == pids
    finally:
        ok(kernel.run("%taas release"))
    assert wait_until_gone(pids) == []
    leftover = {n for n in shm_entries() - shm_before if re.fullmatch(r"taas-[0-9a-f]{12}-.*", n)}
    assert leftover == set()


# Local launcher only (suite time): the failure reaches the ranks through the transport
# (plane.fail); on the launcher it is one more exit of the loader job, which the tests on both
# launchers see too (workers that sent their units end while the kept ranks stay).
@pytest.mark.parametrize("how, expected", [
    ("raise", "loader:bad_raise:0 failed: ValueError: sample 13 is corrupt"),
    ("kill", "loader:bad_kill:0 was killed by SIGKILL"),
])
def test_a_failing_loader_in_a_kept_cell_is_shown_and_the_ranks_stay(kernel, clean, how, expected, tmp_path):
    name = f"bad_{how}"
    ok(kernel.run(f"{name} = DataLoader(Own(40, fail=13, how='{how}', after={str(tmp_path)!r}), batch_size=2)\n"
                   f"taas.register({name})"))
    try:
        ok(kernel.run("%%taas --gpus 2 --keep\nimport os\npid = os.getpid()\nkept = 'yes'"))
        pids = [p.pid for p in _ranks(kernel)]
        # One worker: it has its first slice ready before it fails (with two, the other one's
        # might not be, and the ranks would get the failure while they wait for it, before the
        # cell's code runs); it fails once both ranks are in the cell's code.
        run = kernel.run(loader_failure_cell(name, str(tmp_path)))
        assert run.error is not None and run.error["ename"] == "JobFailed", run.stdout + run.stderr
        tb = plain(run.traceback)
        assert tb.splitlines()[0] == expected, tb
        if how == "raise":  # the loader's own traceback, at its notebook line
            assert re.search(r"Cell In\[\d+\], line \d+, in __getitem__", tb), tb
        assert "rank0: its cell raised the loader's failure" in tb, tb
        assert "they and their state stay" in tb, tb
        assert "state is lost" not in run.stderr
        assert wait_until_gone(_loader_workers(kernel)) == []
        assert [p.pid for p in _ranks(kernel)] == pids
        got = [line for line in ranks.per_rank(run.stdout).splitlines() if " GOT " in line]
        got = sorted(line.split(" GOT ")[1] for line in got)
        assert got == [f"LoaderFailed {expected}"] * 2, (run.stdout, run.stderr, tb)
        # Their state is there.
        assert ok(kernel.run("%%taas\nkept + str(os.getpid() == pid)")).result == "'yesTrue'"
        # And a healthy loader in the next cell.
        after = ok(kernel.run("%%taas\nprint('next', sum(len(b) for b in loader))"))
        assert sum(int(n) for n in re.findall(r"next (\d+)", ranks.per_rank(after.stdout))) == 22, after.stdout
    finally:
        kernel.run(f"taas.unregister({name})")
        ok(kernel.run("%taas release"))
    assert wait_until_gone(pids) == []


@on_both_launchers
def test_a_killed_kernel_leaves_no_kept_rank_loader_worker_or_shared_memory(tmp_path, kernel_launcher):
    k = kernel_on(kernel_launcher, str(tmp_path))
    try:
        assert k.run(cell(SETUP)).error is None
        ok(k.run("%%taas --gpus 2 --keep\nx = 1"))
        k.run("slow = DataLoader(Own(2000), batch_size=1)\ntaas.register(slow)")
        k.execute("%%taas --cpus 2 --units 1000\nimport time\nfor b in slow:\n    time.sleep(1)")

        def running():  # 2 kept ranks and the cell's 2 loader workers, its blocks made
            maps = [m for p in _ranks(k) for m in _data_maps(p.pid)]
            jobs = {m.split("-")[1] for m in maps}
            if len(_ranks(k)) == 2 and len(_loader_workers(k)) == 2 and len(jobs) == 1:
                job = f"taas-{next(iter(jobs))}-"
                if len([n for n in shm_entries() if n.startswith(job)]) > 1:  # header and blocks
                    return job
            return None

        job = wait_for(running, what="kept ranks reading from the cell's loader workers")
        tree = [p.pid for p in k.descendants()]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
        wait_for(lambda: not [n for n in shm_entries() if n.startswith(job)], timeout=5,
                 what="the cell's shared memory removed")
    finally:
        k.shutdown()


@on_both_launchers
def test_an_interrupt_of_a_kept_cell_reading_a_loader_keeps_the_ranks_and_ends_the_workers(kernel, clean):
    ok(kernel.run("crawl = DataLoader(Own(2000), batch_size=1)\ntaas.register(crawl)"))
    try:
        ok(kernel.run("%%taas --gpus 2 --keep\nimport os, time\npid = os.getpid()"))
        pids = [p.pid for p in _ranks(kernel)]
        seen = {}

        def on_output(out):
            if "[rank1] reading" in ranks.per_rank(out.stdout) and "at" not in seen:
                seen["at"] = True
                kernel.km.interrupt_kernel()

        run = kernel.run(cell("""
            %%taas --cpus 2 --units 1000
            for k, b in enumerate(crawl):
                if k == 2:
                    print("reading", flush=True)
                time.sleep(0.05)
            """), on_output=on_output)
        assert "at" in seen
        assert run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.stderr
        assert "the kept ranks and their state stay" in plain(run.traceback)
        assert wait_until_gone(_loader_workers(kernel)) == []
        assert [p.pid for p in _ranks(kernel)] == pids
        after = ok(kernel.run("%%taas --units 8\nprint('next', sum(len(b) for b in crawl), os.getpid() == pid)"))
        assert sorted(re.findall(r"next (\d+) True", ranks.per_rank(after.stdout))) == ["4", "4"], after.stdout
    finally:
        kernel.run("taas.unregister(crawl)")
        ok(kernel.run("%taas release"))
    assert wait_until_gone(pids) == []
