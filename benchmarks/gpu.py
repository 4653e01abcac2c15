"""GPU benchmark: taas's GPU paths side by side with their references, in one run.

    python benchmarks/gpu.py [--rounds 3] [--units 256] [--workers 4] [--json PATH]

On a machine without CUDA it prints "no CUDA: skipped" and exits 0.  Figures are printed as
ratios of things measured in this same run (machines are noisy; no absolute goal is asserted):

1. A 1-rank NCCL job's start: cold (the first job of a fresh session: the start process imports
   torch, NCCL initialises) and warm (the median of the next ones), against a warm 1-rank gloo
   CPU job.
2. Loader throughput to the GPU: a registered loader (M loader workers, shared memory, the
   view's pinned batches) against ``DataLoader(num_workers=M, pin_memory=True)`` iterated in
   this process; both move every 4 MiB batch with ``.to("cuda", non_blocking=True)`` and reduce
   it on the GPU.  GB/s from the first batch to the last (steady state: each side's start-up
   is not counted), and whether the batches were pinned.
3. Pinning, the design note of ``taas/data/view.py``: for a 64 MiB shared-memory block, copying
   it into torch's pinned cache (what the view does) against registering the block itself with
   ``cudaHostRegister`` (cost per block, once per mapping), and host-to-device copies from the
   pinned copy, the registered block and the plain pageable block.  The view copies: a
   registered block goes back to its loader worker when the rank's tensors are garbage, which
   can be while a non-blocking copy still reads it, and registration costs more than the copy
   unless a block is reused many times.
4. A 1 GiB CUDA value from the notebook to the rank, and a 1 GiB CUDA result back: the job's
   wall time minus a warm trivial job's, per GiB (the spec's goal for results: <= 0.5 s/GiB).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

MiB, GiB = 1 << 20, 1 << 30
SAMPLE = 16384  # float32 values: 64 KiB
BATCH = 64  # samples: a 4 MiB batch
BATCHES = 64  # a 256 MiB dataset


class Samples(torch.utils.data.Dataset):
    """64 KiB float32 samples, made once (the loader's cost is collation and transport)."""

    def __init__(self, n: int = BATCH * BATCHES):
        self.data = torch.rand(n, SAMPLE)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def median_wall(run, source: str, options: str, rounds: int, namespace: dict | None = None) -> float:
    walls = []
    for _ in range(rounds):
        r = run(source, options, namespace).ok()
        walls.append(r.wall_s)
    return statistics.median(walls)


# -- 1. start ---------------------------------------------------------------------------------
TRIVIAL = """
import torch.distributed as dist
rank = dist.get_rank()
"""


def start_times(session, run, rounds: int) -> dict:
    cold = run(TRIVIAL, "--gpus 1").ok().wall_s
    warm = median_wall(run, TRIVIAL, "--gpus 1", max(rounds, 5))
    gloo = median_wall(run, TRIVIAL, "--gpus 1 --device cpu", max(rounds, 5))
    return {"nccl_cold_s": cold, "nccl_warm_s": warm, "gloo_warm_s": gloo}


# -- 2. loader throughput -----------------------------------------------------------------------
LOADER_CELL = """
import time, torch
dev = torch.device("cuda")
acc = torch.zeros((), device=dev)
first, moved, pinned = None, 0, True
while len(loader):
    for x in loader:
        pinned = pinned and x.is_pinned()
        if first is None:
            first = time.perf_counter()
        else:
            moved += x.numel() * x.element_size()
        acc += x.to(dev, non_blocking=True).sum()
torch.cuda.synchronize()
bench = dict(seconds=time.perf_counter() - first, bytes=moved, pinned=pinned)
"""


def dataloader_rate(dataset, units: int, workers: int) -> dict:
    """The reference: DataLoader(pin_memory=True) in this process, same batches, same use."""
    dev = torch.device("cuda")
    acc = torch.zeros((), device=dev)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers, pin_memory=True,
                                         persistent_workers=True)  # as taas's workers stay for every pass
    first, moved, pinned, n = None, 0, True, 0
    while n < units:
        for x in loader:
            if n >= units:
                break
            n += 1
            pinned = pinned and x.is_pinned()
            if first is None:
                first = time.perf_counter()
            else:
                moved += x.numel() * x.element_size()
            acc += x.to(dev, non_blocking=True).sum()
    torch.cuda.synchronize()
    return dict(seconds=time.perf_counter() - first, bytes=moved, pinned=pinned)


def loader_rates(run, rounds: int, units: int, workers: int) -> dict:
    import taas

    dataset = Samples()
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    taas.register(loader)
    ours, theirs = [], []
    try:
        for _ in range(rounds):
            r = run(LOADER_CELL, f"--gpus 1 --cpus {workers} --units {units}", {"loader": loader}).ok()
            ours.append(r.values["bench"])
            theirs.append(dataloader_rate(dataset, units, workers))
    finally:
        taas.unregister(loader)

    def best(results):
        rate = max(b["bytes"] / b["seconds"] for b in results)
        return {"GB_s": rate / 1e9, "pinned": all(b["pinned"] for b in results)}

    return {"taas": best(ours), "dataloader_pin_memory": best(theirs)}


# -- 3. pinning: copy into the pinned cache, or register the block ------------------------------
def pinning_costs(rounds: int, size: int = 64 * MiB) -> dict:
    dev = torch.device("cuda")
    block = mmap.mmap(-1, size)  # shared and anonymous, as a shared-memory block is mapped
    host = torch.frombuffer(block, dtype=torch.uint8)
    host.fill_(1)  # fault the pages in: a block the worker wrote
    target = torch.empty(size, dtype=torch.uint8, device=dev)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(max(rounds, 3)):
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
        return best

    host.pin_memory()  # warm torch's pinned cache: later copies allocate nothing
    copy_s = timed(lambda: host.pin_memory())
    pinned = host.pin_memory()
    h2d_pinned_s = timed(lambda: target.copy_(pinned, non_blocking=True))
    h2d_pageable_s = timed(lambda: target.copy_(host))
    cudart = torch.cuda.cudart()
    register_s = float("inf")
    h2d_registered_s = float("nan")
    for _ in range(max(rounds, 3)):
        began = time.perf_counter()
        err = cudart.cudaHostRegister(host.data_ptr(), size, 0)
        took = time.perf_counter() - began
        if int(err) != 0:
            register_s = float("nan")
            break
        register_s = min(register_s, took)
        h2d_registered_s = timed(lambda: target.copy_(host, non_blocking=True))
        cudart.cudaHostUnregister(host.data_ptr())
    pinned = host = target = None  # the timed closures let go too: the block can close
    try:
        block.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with the process
        pass
    gbs = {k: size / v / 1e9 for k, v in dict(copy_into_pinned=copy_s, register_block=register_s,
                                               h2d_from_pinned=h2d_pinned_s, h2d_from_registered=h2d_registered_s,
                                               h2d_pageable=h2d_pageable_s).items()}
    return {"block_MiB": size // MiB, "GB_s": gbs}


# -- 4. 1 GiB CUDA value out, 1 GiB CUDA result back ----------------------------------------------
def big_values(run, rounds: int) -> dict:
    n = GiB // 4
    base = median_wall(run, TRIVIAL, "--gpus 1", rounds)
    namespace = {"big": torch.full((n,), 1.0, device="cuda")}
    out_s = []
    for _ in range(rounds):
        r = run("seen = float(big[-1])", "--gpus 1", namespace).ok()
        assert r.values["seen"] == 1.0
        out_s.append(r.wall_s - base)
    del namespace["big"]
    back_s = []
    for _ in range(rounds):
        ns: dict = {}
        r = run(f"import torch\nresult = torch.full(({n},), 2.0, device='cuda')", "--gpus 1", ns).ok()
        assert ns["result"].numel() == n
        back_s.append(r.wall_s - base)
        ns.clear()
    torch.cuda.empty_cache()
    return {"trivial_job_s": base, "value_to_rank_s_per_GiB": min(out_s), "result_back_s_per_GiB": min(back_s)}


# -----------------------------------------------------------------------------------------------
def _start_line(s: dict) -> str:
    return (f"NCCL 1-rank job start: cold {s['nccl_cold_s']:.2f} s, warm {s['nccl_warm_s']:.2f} s "
            f"(cold/warm {s['nccl_cold_s'] / s['nccl_warm_s']:.1f}x); warm gloo CPU job {s['gloo_warm_s']:.2f} s "
            f"(NCCL/gloo warm {s['nccl_warm_s'] / s['gloo_warm_s']:.2f}x)")


def _loader_line(f: dict) -> str:
    t, d = f["taas"], f["dataloader_pin_memory"]
    return (f"loader -> GPU: taas {t['GB_s']:.2f} GB/s (pinned: {t['pinned']}) vs DataLoader(pin_memory=True) "
            f"{d['GB_s']:.2f} GB/s (pinned: {d['pinned']}): {t['GB_s'] / d['GB_s']:.2f}x")


def _pinning_line(f: dict) -> str:
    p = f["GB_s"]
    return (f"pinning a {f['block_MiB']} MiB block: copy into pinned cache "
            f"{p['copy_into_pinned']:.1f} GB/s, cudaHostRegister {p['register_block']:.1f} GB/s "
            f"(copy/register {p['copy_into_pinned'] / p['register_block']:.2f}x); H2D from pinned "
            f"{p['h2d_from_pinned']:.1f}, registered {p['h2d_from_registered']:.1f}, "
            f"pageable {p['h2d_pageable']:.1f} GB/s (pinned/pageable {p['h2d_from_pinned'] / p['h2d_pageable']:.2f}x)")


def _big_line(b: dict) -> str:
    return (f"1 GiB CUDA value to the rank {b['value_to_rank_s_per_GiB']:.2f} s/GiB, 1 GiB CUDA result back "
            f"{b['result_back_s_per_GiB']:.2f} s/GiB (goal <= 0.5: {b['result_back_s_per_GiB'] / 0.5:.2f}x of it), "
            f"over a {b['trivial_job_s']:.2f} s trivial job")


SECTIONS = (("start", _start_line), ("loader", _loader_line), ("pinning", _pinning_line), ("big", _big_line))


def report(figures: dict) -> None:
    for i, (name, line) in enumerate(SECTIONS, 1):
        if name not in figures:
            continue
        f = figures[name]
        print(f"{i}. " + (f"{name}: failed: {f['error']}" if "error" in f else line(f)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--units", type=int, default=256, help="4 MiB batches per loader run")
    parser.add_argument("--workers", type=int, default=4, help="loader workers (and DataLoader workers)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 0
    from taas.session import Session
    from tests.gpu.harness import OFFLINE, run_cell

    os.environ.update(OFFLINE)
    workdir = tempfile.mkdtemp(prefix="taas-gpu-bench-")
    os.chdir(workdir)
    session = Session()

    def run(source, options="--gpus 1", namespace=None):
        return run_cell(session, source, options, namespace)

    figures: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    measure = {  # in this order: the start first, while the session is cold
        "start": lambda: start_times(session, run, args.rounds),
        "loader": lambda: loader_rates(run, args.rounds, args.units, args.workers),
        "pinning": lambda: pinning_costs(args.rounds),
        "big": lambda: big_values(run, args.rounds),
    }
    failed = False
    try:
        for name, fn in measure.items():
            try:
                figures[name] = fn()
            except Exception as exc:  # one section failing still leaves the others' figures
                figures[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                failed = True
    finally:
        session.close()
    print(f"{figures['device']}, torch {figures['torch']}")
    report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
