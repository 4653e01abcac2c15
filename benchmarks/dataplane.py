"""Data plane benchmark: registered loaders against DataLoader and memcpy, in one run.

    python benchmarks/dataplane.py [--units 1000] [--slow-units 400] [--rounds 3] [--touch]

1. Throughput.  4 MiB float32 batches (64 samples of 64 KiB, collated), delivered to N=2 ranks
   by M=2 loader workers; against the same DataLoader with num_workers=2 iterated in one
   process, and against a plain single-thread memcpy of the same bytes (each batch's samples
   copied from the dataset into a reused buffer).  Units/s and GB/s are counted where the data
   arrives (all ranks together), from the first unit to the last.  ``--touch`` makes every
   consumer read each batch once (a sum) in all three.
2. Waiting.  A loader that sleeps 10 ms per unit, M=4 workers, N=2 ranks that do 5 ms of work
   (a sleep: a GPU step) per unit: the share of step time the ranks wait for data after the
   prefetch, against the same loop with an in-rank DataLoader(num_workers=0).

Goals (issue 3): throughput >= 1.0x the DataLoader and >= 0.4x memcpy; waiting <= 5% (vs ~67%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils.data import DataLoader, Dataset

import taas
from taas import directive
from taas.session import Session

MiB = 1 << 20
SAMPLE = 16384  # float32 values: 64 KiB
BATCH = 64  # samples: a 4 MiB batch
BATCHES = 64  # a 256 MiB dataset: larger than the caches


class Samples(Dataset):
    def __init__(self):
        self.data = torch.randn(BATCHES * BATCH, SAMPLE)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class Slow(Dataset):
    def __init__(self, n=100):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.010)
        return torch.full((64, 32), float(i))


class Quiet:
    """A sink that keeps the job's output (ranks print their figures as lines)."""

    def __init__(self):
        self.lines = []

    def write(self, stream, text):
        self.lines.extend(text.splitlines())

    def progress(self, key, stream, text, final):
        pass


def figures(lines: list[str], tag: str) -> list[list[float]]:
    out = []
    for line in lines:
        if tag in line:
            out.append([float(x) for x in line.split(tag, 1)[1].split()])
    return out


# -- 1. throughput -----------------------------------------------------------------------------
RANK_LOOP = """
import time
touch = {touch}
first = last = None
count = 0
while len(loader):  # pass after pass until K is used up
    for x in loader:
        if touch:
            x.sum()
        last = time.monotonic()
        if first is None:
            first = last
        count += 1
print("FIG", first, last, count)
"""


def taas_throughput(session, units: int, touch: bool) -> float:
    loader = DataLoader(Samples(), batch_size=BATCH, shuffle=True)
    taas.register(loader, prefetch=2)
    try:
        sink = Quiet()
        options = directive.parse_options(f"--gpus 2 --cpus 2 --units {units}")
        session.run_cell(RANK_LOOP.format(touch=touch), {"loader": loader}, options, sink=sink)
    finally:
        taas.unregister(loader)
    rows = figures(sink.lines, "FIG ")
    first, last, count = min(r[0] for r in rows), max(r[1] for r in rows), sum(r[2] for r in rows)
    assert count == units, (count, units)
    return (count - 1) / (last - first)


def dataloader_throughput(units: int, touch: bool) -> float:
    loader = DataLoader(Samples(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    count, first = 0, None
    while count < units:
        for x in loader:
            if touch:
                x.sum()
            last = time.monotonic()
            if first is None:
                first = last
            count += 1
            if count == units:
                break
    return (count - 1) / (last - first)


def memcpy_throughput(units: int, touch: bool) -> float:
    data = Samples().data
    dst = torch.empty(BATCH, SAMPLE)
    order = torch.randperm(BATCHES)
    start = time.monotonic()
    for u in range(units):
        b = int(order[u % BATCHES])
        dst.copy_(data[b * BATCH:(b + 1) * BATCH])
        if touch:
            dst.sum()
    return units / (time.monotonic() - start)


# -- 2. waiting ----------------------------------------------------------------------------------
STEP_LOOP = """
import time
waited = 0.0
start = time.monotonic()
count = 0
while len(slow):
    it = iter(slow)
    while True:
        t = time.monotonic()
        try:
            x = next(it)
        except StopIteration:
            break
        waited += time.monotonic() - t
        time.sleep(0.005)  # the step's work
        count += 1
print("WAIT", waited, time.monotonic() - start, count)
"""


def taas_waiting(session, units: int) -> tuple[float, list[str]]:
    slow = DataLoader(Slow(), batch_size=None)
    taas.register(slow)
    try:
        sink = Quiet()
        options = directive.parse_options(f"--gpus 2 --cpus 4 --units {units}")
        session.run_cell(STEP_LOOP, {"slow": slow}, options, sink=sink)
    finally:
        taas.unregister(slow)
    rows = figures(sink.lines, "WAIT ")
    assert sum(r[2] for r in rows) == units
    delivered = [line for line in sink.lines if "units delivered" in line]
    return sum(r[0] for r in rows) / sum(r[1] for r in rows), delivered


def in_rank_waiting(units: int) -> float:
    slow = DataLoader(Slow(), batch_size=None, num_workers=0)
    waited, count, start = 0.0, 0, time.monotonic()
    while count < units:
        it = iter(slow)
        while count < units:
            t = time.monotonic()
            try:
                next(it)
            except StopIteration:
                break
            waited += time.monotonic() - t
            time.sleep(0.005)
            count += 1
    return waited / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--slow-units", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians reported")
    parser.add_argument("--touch", action="store_true", help="consumers read every batch once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gb = 4 * MiB / 1e9
    session = Session()
    try:
        session.warm()
        taas_throughput(session, 20, args.touch)  # warm the start process
        runs = {"taas": [], "dl": [], "mem": []}
        for _ in range(args.rounds):  # interleaved: a busy moment hurts all three alike
            runs["taas"].append(taas_throughput(session, args.units, args.touch))
            runs["dl"].append(dataloader_throughput(args.units, args.touch))
            runs["mem"].append(memcpy_throughput(args.units, args.touch))
        ours, dl, mem = (statistics.median(runs[k]) for k in ("taas", "dl", "mem"))

        def rounds(k):
            return ", ".join(f"{v:.0f}" for v in runs[k])

        print(f"throughput, 4 MiB float32 batches, {args.units} units, median of {args.rounds} rounds"
              f"{' (consumers read every batch)' if args.touch else ''}:")
        print(f"  taas M=2 N=2              {ours:6.0f} units/s  {ours * gb:6.2f} GB/s   ({rounds('taas')})")
        print(f"  DataLoader num_workers=2  {dl:6.0f} units/s  {dl * gb:6.2f} GB/s   ({rounds('dl')})")
        print(f"  memcpy, 1 thread          {mem:6.0f} units/s  {mem * gb:6.2f} GB/s   ({rounds('mem')})")
        print(f"  ratio: {ours / dl:.2f}x the DataLoader (goal >= 1.0), {ours / mem:.2f}x memcpy (goal >= 0.4); "
              f"against the best rounds: {max(runs['taas']) / max(runs['dl']):.2f}x, "
              f"{max(runs['taas']) / max(runs['mem']):.2f}x")
        shares, summary = [], []
        for _ in range(args.rounds):
            share, summary = taas_waiting(session, args.slow_units)
            shares.append(share)
        base = in_rank_waiting(args.slow_units // 2)
        print(f"waiting, 10 ms/unit loader, 5 ms/unit steps, {args.slow_units} units, median of {args.rounds} rounds:")
        print(f"  taas M=4 N=2: ranks wait {statistics.median(shares):.1%} of step time after prefetch "
              f"(goal <= 5%)   ({', '.join(f'{s:.1%}' for s in shares)})")
        print(f"  in-rank DataLoader(num_workers=0): {base:.1%}")
        for line in summary:
            print("  last round: " + line)
    finally:
        session.close()


if __name__ == "__main__":
    main()
