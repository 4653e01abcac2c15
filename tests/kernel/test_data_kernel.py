"""Registered loaders end to end through a real Jupyter kernel: units, passes, failures, leaks."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.support.kernel_driver import (Kernel, cell, plain, process_name, shm_entries, wait_for, wait_until_gone)
from tests.support import ranks

pytestmark = pytest.mark.kernel

SETUP = """
import collections, os, time
import numpy as np
import torch
import taas
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

Pair = collections.namedtuple("Pair", "a b")

class Own(Dataset):
    '''Each sample knows its own index, in a nested structure.'''
    def __init__(self, n, fail=None, how=None):
        self.n, self.fail, self.how = n, fail, how
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == self.fail:
            if self.how == "raise":
                raise ValueError(f"sample {i} is corrupt")
            if self.how == "kill":
                os.kill(os.getpid(), 9)
            if self.how == "hang":
                time.sleep(600)
        if self.how == "slow":
            time.sleep(0.05)
        return {"i": torch.tensor(i), "x": torch.full((3,), i / 2), "meta": [f"s{i}", np.array([i, i % 3])],
                "pair": Pair(i, torch.tensor([i, -i], dtype=torch.int16))}

class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))

def same(a, b):
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a).__name__ == type(b).__name__ and len(a) == len(b) and all(map(same, a, b))
    return a == b

loader = DataLoader(Own(22), batch_size=4, shuffle=True)   # 6 batches a pass, the last of 2
taas.register(loader)
"""

# Every rank logs, per `for`, len(loader) before it and the index lists of its batches.
EPOCHS = """
import os, json
log = []
for epoch in range({epochs}):
    n = len({name})
    got = []
    for batch in {name}:
        assert same(batch, default_collate([{name}_ds[i] for i in batch["i"].tolist()]))
        got.append(batch["i"].tolist())
    log.append([n, got])
print("LOG", json.dumps(log))
"""


def logs(run) -> dict[int, list]:
    out = {}
    for line in ranks.per_rank(run.stdout).splitlines():
        match = re.match(r"\[rank(\d+)\] LOG (.*)", line)
        if match:
            out[int(match.group(1))] = json.loads(match.group(2))
    return out


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(str(tmp_path_factory.mktemp("notebook")))
    run = k.run(cell(SETUP))
    assert run.error is None, run.traceback
    yield k
    k.shutdown()




def test_every_unit_exactly_once_in_passes_with_equal_structures(kernel, clean):
    kernel.run("loader_ds = loader.dataset")
    run = kernel.run("%%taas --gpus 2 --cpus 2 --units 15\n" + cell(EPOCHS.format(epochs=4, name="loader")))
    assert run.error is None, run.traceback
    per_rank = logs(run)
    assert set(per_rank) == {0, 1}
    # 6 batches a pass: passes 0 and 1 whole, pass 2 cut at K = 15, then nothing.
    assert [[n for n, _ in per_rank[r]] for r in (0, 1)] == [[3, 3, 2, 0], [3, 3, 1, 0]]
    for r in (0, 1):
        assert all(n == len(got) for n, got in per_rank[r])
    for epoch in range(3):
        indices = [i for r in (0, 1) for batch in per_rank[r][epoch][1] for i in batch]
        assert len(indices) == len(set(indices))  # none repeated within a pass
        if epoch < 2:
            assert sorted(indices) == list(range(22))  # a whole pass: every sample once
    assert per_rank[0][0][1] != per_rank[0][1][1]  # reshuffled per pass
    shown = " ".join(str(data.get("text/plain", "")) for _, data in run.displays)
    assert "units ready" in shown and "/15 units ready" in shown
    summary = [line for line in run.stdout.splitlines() if "units delivered" in line]
    assert len(summary) == 1 and "15/15 units delivered to 2 ranks by 2 workers" in summary[0], run.stdout
    assert re.search(r"ranks waited for data \d+\.\d% of the time", summary[0])


def test_the_same_units_reach_the_same_ranks_whatever_the_worker_count(kernel, clean):
    body = "import os, json\nprint('LOG', json.dumps([b['i'].tolist() for b in loader]))"
    results = []
    for cpus in (1, 3):
        kernel.run("torch.manual_seed(0)")
        run = kernel.run(f"%%taas --gpus 2 --cpus {cpus}\n{body}")
        assert run.error is None, run.traceback
        results.append(logs(run))
    assert results[0] == results[1]
    kernel.run("torch.manual_seed(1)")
    other = logs(kernel.run(f"%%taas --gpus 2 --cpus 2\n{body}"))
    assert other != results[0]


def test_an_iterable_dataset_needs_and_takes_units(kernel, clean):
    kernel.run("stream = DataLoader(Stream(), batch_size=3)\ntaas.register(stream)")
    refused = kernel.run("%%taas --gpus 2\nfor b in stream: pass\nprint('ran')")
    usage = [line for line in refused.stderr.splitlines() if line.startswith("UsageError")]
    assert len(usage) == 1 and "`stream`" in usage[0] and "--units" in usage[0], refused.stderr
    assert "ran" not in refused.stdout
    run = kernel.run(cell("""
        %%taas --gpus 2 --cpus 2 --units 6
        import json
        try:
            len(stream)
        except TypeError:
            pass
        print("LOG", json.dumps([[b.tolist() for b in stream] for epoch in range(3)]))
        """))
    assert run.error is None, run.traceback
    per_rank = logs(run)
    # 4 batches a pass ([0,1,2] [3,4,5] [6,7,8] [9]); 6 units: a pass and a half.
    assert per_rank[0] == [[[0, 1, 2], [6, 7, 8]], [[0, 1, 2]], []]
    assert per_rank[1] == [[[3, 4, 5], [9]], [[3, 4, 5]], []]


def test_a_function_that_reads_the_loader_gets_the_view(kernel, clean):
    kernel.run("def count():\n    return sum(len(b['i']) for b in loader)")
    run = kernel.run("%%taas --gpus 2 --cpus 2\nprint('counted', count())")
    assert run.error is None, run.traceback
    counted = sorted(int(x) for x in re.findall(r"counted (\d+)", run.stdout))
    assert sum(counted) == 22 and len(counted) == 2  # one pass, shared, not 22 each


def test_a_loader_read_only_by_functions_never_travels_to_the_ranks(kernel, clean):
    kernel.run(cell("""
        class Tattling(torch.utils.data.Dataset):
            \"\"\"Says where it is unpickled: loader workers may, ranks must not.\"\"\"
            def __init__(self):
                self.state = "non-empty, so unpickling calls __setstate__"
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return i
            def __setstate__(self, state):
                self.__dict__.update(state)
                if "RANK" in os.environ:
                    print("dataset unpickled in a rank", flush=True)
        tattling = DataLoader(Tattling(), batch_size=2)
        taas.register(tattling)
        by_name = {"train": tattling}
        def batches():  # len() first: it is the share of the next pass, 0 once used up
            return len(by_name["train"]), [len(b) for b in tattling]
        """))
    run = kernel.run("%%taas --gpus 2\nprint('seen', batches())")
    kernel.run("taas.unregister(tattling)")
    assert run.error is None, run.traceback
    assert "unpickled in a rank" not in run.stdout
    out = ranks.per_rank(run.stdout)
    assert "[rank0] seen (2, [2, 2])" in out and "[rank1] seen (2, [2, 2])" in out


def test_a_rank_that_stops_early_ends_the_job_promptly(kernel, clean):
    kernel.run("slow = DataLoader(Own(2000, how='slow'), batch_size=1)\ntaas.register(slow)")
    started = time.monotonic()
    run = kernel.run("%%taas --gpus 2 --cpus 2 --units 1000\nfor b in slow:\n    break\nprint('done')")
    assert run.error is None, run.traceback
    assert time.monotonic() - started < 120  # the workers stopped once the ranks were done
    assert "2/1000 units delivered" in run.stdout


@pytest.mark.parametrize("how, expected", [
    ("raise", "loader:bad_raise:0 failed: ValueError: sample 13 is corrupt"),
    ("kill", "loader:bad_kill:0 was killed by SIGKILL"),
])
def test_a_failing_loader_stops_the_job_naming_loader_and_worker(kernel, clean, how, expected):
    name = f"bad_{how}"
    kernel.run(f"{name} = DataLoader(Own(40, fail=13, how='{how}'), batch_size=2)\ntaas.register({name})")
    started = time.monotonic()
    run = kernel.run(f"%%taas --gpus 2 --cpus 2\nimport time\nfor b in {name}:\n    time.sleep(0.01)")
    took = time.monotonic() - started
    assert run.status == "error"
    tb = plain(run.traceback)
    assert tb.splitlines()[0] == expected, tb
    if how == "raise":  # the loader's own traceback, at its notebook line
        assert re.search(r"Cell In\[\d+\], line \d+, in __getitem__", tb), tb
        assert 'raise ValueError(f"sample {i} is corrupt")' in tb
    assert "rank0: stopped after" in tb and "rank1: stopped after" in tb
    assert took < 120  # stopped at the failure, not left to a collective timeout


HANG_TIMEOUT = 15  # s


@pytest.mark.parametrize("fail, expected", [
    (13, "loading unit 6 while rank0 waited"),  # after the ranks started
    (1, "loading unit 0, before the ranks could start"),  # in the first slice
])
def test_a_hanging_loader_is_named_at_the_timeout(kernel, clean, fail, expected):
    # The timeout must leave the ranks time to start and reach the loader: 4 s was too short on
    # a loaded 2-core machine (the ranks still in their rendezvous, so no loader to name).
    kernel.run(f"stuck = DataLoader(Own(40, fail={fail}, how='hang'), batch_size=2)\ntaas.register(stuck)")
    started = time.monotonic()
    run = kernel.run(f"%%taas --gpus 2 --cpus 2 --timeout {HANG_TIMEOUT}\nfor b in stuck:\n    pass")
    took = time.monotonic() - started
    kernel.run("taas.unregister(stuck)")
    assert run.status == "error"
    tb = plain(run.traceback)
    first = tb.splitlines()[0]
    assert f"--timeout {HANG_TIMEOUT}s" in first and "loader `stuck` worker 0 (loader:stuck:0)" in first, tb
    assert expected in first, first
    assert "time.sleep(600)" in tb  # where it hung
    assert took < HANG_TIMEOUT + 120  # stopped at the timeout, not left hanging


def test_malformed_data_events_from_a_rank_are_ignored(kernel, clean):
    """A rank's own code can write anything to taas's events pipe: data-plane lines the kernel
    cannot read are ignored (logged on ``taas``), and the job and its summary are unaffected."""
    run = kernel.run(cell("""
        %%taas --gpus 2 --cpus 1
        import json, os
        fd = int(os.environ["TAAS_EVENTS_FD"])
        for line in ({"kind": "data.progress"},
                     {"kind": "data.stats", "loader": "loader", "rank": "x"},
                     {"kind": "data.progress", "loader": "loader", "worker": 9, "produced": 1, "ready": True},
                     {"kind": "data.stats", "loader": "loader", "rank": 7, "units": 99, "bytes": 1,
                      "wait_s": 0.0, "elapsed_s": 1.0},
                     {"kind": "data.started", "loader": "loader", "rank": 0, "prefetch_s": -1}):
            os.write(fd, (json.dumps(line) + "\\n").encode())
        print("got", sum(len(b["i"]) for b in loader))
        """))
    assert run.error is None, run.traceback
    assert sum(int(n) for n in re.findall(r"got (\d+)", run.stdout)) == 22, run.stdout
    summary = [line for line in run.stdout.splitlines() if "units delivered" in line]
    assert len(summary) == 1 and "6/6 units delivered to 2 ranks by 1 worker" in summary[0], run.stdout


def test_register_errors_and_status_in_the_notebook(kernel):
    again = kernel.run("taas.register(loader)")
    assert again.error and again.error["ename"] == "RegistrationError" and "already registered" in again.error["evalue"]
    bad = kernel.run("import threading\nclass Locked(list):\n    pass\nlocked = Locked([1])\n"
                     "locked.lock = threading.Lock()\ntaas.register(locked)")
    assert bad.error and "`loader.lock` is _thread.lock" in bad.error["evalue"]
    names = kernel.run("print(taas.is_registered(loader), 'loader' in taas.registered(), taas.get_worker_info())")
    assert names.stdout.strip() == "True True None"
    status = kernel.run("%taas")
    assert re.search(r"registered loaders: .*\bloader\b", status.stdout), status.stdout
    info = kernel.run("%%taas --gpus 2\nprint('info', taas.get_worker_info())")
    assert "[rank1] info WorkerInfo(id=1, num_workers=2)" in info.stdout, info.stdout + info.traceback


def test_interrupt_during_prefetch_cleans_up(kernel, clean):
    kernel.run("crawl = DataLoader(Own(100, how='slow'), batch_size=4)\ntaas.register(crawl)")
    msg_id = kernel.execute("%%taas --gpus 2 --cpus 1\nfor b in crawl:\n    pass")
    wait_for(lambda: any(process_name(p).startswith("taas-loader") for p in kernel.descendants()),
             what="the loader worker running")
    kernel.km.interrupt_kernel()
    reply = kernel.reply(msg_id)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    after = kernel.run("%%taas --gpus 2\nprint('next', sum(len(b['i']) for b in loader))")
    assert after.error is None and "[rank0] next" in ranks.per_rank(after.stdout)


def test_a_killed_kernel_leaves_no_loader_worker_or_shared_memory(tmp_path):
    k = Kernel(str(tmp_path))
    try:
        assert k.run(cell(SETUP)).error is None
        k.run("slow = DataLoader(Own(2000, how='slow'), batch_size=1)\ntaas.register(slow)")
        k.execute("%%taas --gpus 2 --cpus 2 --units 1000\nimport time\nfor b in slow:\n    time.sleep(1)")

        def running_job():  # the job whose header segment the kernel (or its job host, where the
            jobs = set()    # job runs) maps, once its blocks exist
            for pid in [k.pid] + [p.pid for p in k.descendants() if "taas.host.serve" in " ".join(p.cmdline())]:
                with open(f"/proc/{pid}/maps") as f:
                    jobs |= set(re.findall(r"/dev/shm/(taas-[0-9a-f]{12})-\d+", f.read()))
            if len(jobs) == 1 and len(processes()) == 4:
                job = next(iter(jobs))
                if len([n for n in shm_entries() if n.startswith(job + "-")]) > 1:  # header and blocks
                    return job
            return None

        def processes():
            return [p for p in k.descendants() if process_name(p).startswith(("taas-rank", "taas-loader"))]

        job = wait_for(running_job, what="2 ranks and 2 loader workers with their blocks")
        tree = [p.pid for p in k.descendants()]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(n.startswith(job + "-") for n in shm_entries()):
            time.sleep(0.1)
        assert [n for n in shm_entries() if n.startswith(job + "-")] == []
    finally:
        k.shutdown()
