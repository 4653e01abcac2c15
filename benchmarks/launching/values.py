"""Big values in warm taas jobs: a notebook tensor the ranks read, and rank 0's result back."""

from __future__ import annotations

import os
import statistics
import textwrap
import time

from benchmarks.launching.job import THINK_TIME, Collect, run_taas

# -- a big notebook value read by the job ------------------------------------------------------
# The cell reads a sample of the notebook's tensor (the time goal: what shipping it costs), or
# sums all of it on every rank (the memory goal: every rank touches every page).
BIG_SAMPLE = "checksum = float(big[:: 1 << 16].sum())\n"
BIG_ALL = "checksum = float(big.sum())\n"


class _MemorySampler:
    """Peak memory of the job, sampled every 20 ms in a thread: the sum over this process (the
    'kernel') and all its descendants (start process, ranks, children forked ahead) of
    Pss_Anon from /proc/PID/smaps_rollup -- private and copy-on-write pages, shared ones split
    between their sharers -- plus what /dev/shm holds beyond ``shm_base`` (the value files and a
    resident tensor's file, counted once however many processes map them)."""

    def __init__(self, shm_base: int):
        import psutil

        self._me = psutil.Process()
        self._shm_base = shm_base
        self.peak = 0
        self._stop = False

    def sample(self) -> int:
        total = 0
        for proc in [self._me] + self._me.children(recursive=True):
            try:
                with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss_Anon:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total + shm_used() - self._shm_base

    def __enter__(self):
        import threading

        def loop():
            while not self._stop:
                self.peak = max(self.peak, self.sample())
                time.sleep(0.02)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run_big(source: str, ranks: int, device: str, repeat: int, mib: int) -> None:
    """Warm jobs side by side in one session: plain, and reading a ``mib`` MiB notebook tensor --
    the first job that references it (it moves to shared memory then) and the jobs after.
    ``session.after_cell()`` runs where the kernel would run it, after each cell."""
    import torch

    from benchmarks.launching.job import new_session

    shm_base = shm_used()
    session = new_session()
    plain, first, sample, whole, fresh = [], [], [], [], []

    def tensor():
        return {"big": torch.randn(mib << 18)}  # float32: mib MiB

    def fill():  # the floor: touching as much new memory in this process, nothing shared
        started = time.perf_counter()
        torch.ones(mib << 18)
        return started

    try:
        run_taas(session, source, ranks, device)  # cold: untimed
        big = tensor()
        run_taas(session, BIG_SAMPLE + source, ranks, device, big)  # big is resident from here
        # Each row THINK_TIME after the one before.  'fresh' follows an untimed plain job, as
        # 'first' does: memory freed seconds ago can be slower to touch again than memory
        # freed just now (a VM may have handed it back to its host).
        rows = ((plain, source, None), (sample, BIG_SAMPLE + source, big), (whole, BIG_ALL + source, big),
                (None, source, None), (fresh, fill, None), (None, source, None), (first, BIG_SAMPLE + source, tensor))
        for _ in range(repeat):
            for out, cell, namespace in rows:
                if callable(namespace):
                    namespace = namespace()  # a new tensor, made before the pause
                time.sleep(THINK_TIME)
                if callable(cell):
                    started = cell()
                    out.append(time.perf_counter() - started)
                    continue
                wall = run_taas(session, cell, ranks, device, namespace)[0]
                if out is not None:
                    out.append(wall)
                del namespace
                session.after_cell()  # what the kernel runs after every cell (taas frees what it held)
        peaks = []
        for cell, namespace in ((source, None), (BIG_ALL + source, big)):
            time.sleep(THINK_TIME)
            with _MemorySampler(shm_base) as sampler:
                run_taas(session, cell, ranks, device, namespace)
            peaks.append(sampler.peak)
    finally:
        session.close()
    med = statistics.median
    gib = 1 << 30
    print(f"  big    warm {med(plain):7.3f} s | + {mib} MiB tensor: first job {med(first):7.3f} s, "
          f"later jobs {med(sample):7.3f} s | summed by every rank {med(whole):7.3f} s")
    print(f"  added  by the {mib} MiB tensor, first job that reads it = {med(first) - med(plain):+.3f} s   "
          f"(goal <= 0.5; it moves to shared memory in place; for scale: filling {mib} MiB of new "
          f"memory here, same pauses, takes {med(fresh):.3f} s)")
    print(f"  added  by the {mib} MiB tensor, later jobs = {med(sample) - med(plain):+.3f} s   (goal <= 0.5)")
    print(f"  memory peak, every rank summing it: {peaks[1] / gib:.2f} GiB vs {peaks[0] / gib:.2f} GiB plain "
          f"(this process with the tensor, start process, ranks; Pss_Anon + /dev/shm growth)")
    print(f"  memory extra for the job = {(peaks[1] - peaks[0]) / gib:.2f} GiB   (goal <= 1)")


# -- big results back -------------------------------------------------------------------------
# Rank 0 makes a value of the given size (a tensor; a model of 16 Linear layers built on meta and
# filled, so no random init dominates), and binds it or not.  Only rank 0 makes it: the other
# ranks' new memory would only add noise on a small machine.
RESULT_TENSOR = "big = torch.full(({n},), 0.5) if dist.get_rank() == 0 else None\n"
RESULT_MODEL = textwrap.dedent("""
    with torch.device("meta"):
        net = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range(16)])
    if dist.get_rank() == 0:
        net = net.to_empty(device="cpu")
        for p in net.parameters():
            p.data.fill_(0.01)
""")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_results(source: str, ranks: int, device: str, repeat: int, mib: int) -> None:
    """Warm jobs side by side in one session, results on: plain; a ``mib`` MiB tensor made and
    bound on rank 0 (brought back: read by the kernel, and for comparison as memory files, the
    way where the kernel may not read rank 0), or made and deleted (not brought back); the same
    for a model of about that size.  Each bound value is touched (summed) in this process, after
    the timed cell, to measure the RSS it added."""
    import torch

    from taas.directive import parse_options
    from taas.job.memory import readback
    from benchmarks.launching.job import new_session

    width = int((mib * (1 << 20) / 4 / 16) ** 0.5)  # 16 square layers of float32: ~mib MiB
    tensor = RESULT_TENSOR.format(n=mib << 18)
    model = RESULT_MODEL.format(width=width)
    rows = {"plain": source, "tensor made": source + tensor + "del big\n", "tensor bound": source + tensor,
            "tensor files": source + tensor, "model made": source + model + "del net\n",
            "model bound": source + model, "model files": source + model}
    times: dict[str, list[float]] = {k: [] for k in rows}
    growth: dict[str, list[float]] = {"tensor bound": [], "model bound": []}
    options = parse_options(f"--gpus {ranks} --device {device}")
    session = new_session()
    read = readback.read

    def refuse(pid, regions):  # what a kernel that may not read rank 0 answers
        raise readback.Unreadable(1, "not permitted (benchmark)")

    try:
        session.run_cell(source, {}, options, sink=Collect())  # cold: untimed
        for _ in range(repeat):
            for name, cell in rows.items():
                time.sleep(THINK_TIME)
                namespace: dict = {}
                rss = _rss()
                readback.read = refuse if name.endswith("files") else read  # type: ignore[assignment]
                started = time.perf_counter()
                got = session.run_cell(cell, namespace, options, sink=Collect())
                times[name].append(time.perf_counter() - started)
                readback.read = read  # type: ignore[assignment]
                if name in growth:
                    value = got.values["big" if name.startswith("tensor") else "net"]
                    parts = [value] if isinstance(value, torch.Tensor) else list(value.parameters())
                    assert all(float(p.detach().sum()) > 0 for p in parts)  # every page touched
                    growth[name].append((_rss() - rss) / (1 << 30))
                    del value, parts
                del got, namespace
                session.after_cell()
    finally:
        session.close()
    med = statistics.median
    plain = med(times["plain"])
    print(f"  results  warm plain {plain:7.3f} s | rank 0 binds a {mib} MiB tensor / a "
          f"{16 * width * (width + 1) * 4 / (1 << 30):.2f} GiB model (16 x Linear({width}, {width}))")
    for kind in ("tensor", "model"):
        bound, made, files = times[f"{kind} bound"], times[f"{kind} made"], times[f"{kind} files"]
        later = bound[1:] or bound
        print(f"  results  {kind}: made, not bound {med(made):7.3f} s | bound: first time {bound[0]:7.3f} s, "
              f"after {med(later):7.3f} s")
        print(f"  added    by bringing the {kind} back (bound - made): first {bound[0] - med(made):+.3f} s, "
              f"after {med(later) - med(made):+.3f} s   (goal <= 0.5 per GiB) | vs plain: first "
              f"{bound[0] - plain:+.3f} s, after {med(later) - plain:+.3f} s")
        print(f"  added    as memory files instead (where the kernel may not read rank 0): first "
              f"{files[0] - med(made):+.3f} s, after {med(files[1:] or files) - med(made):+.3f} s | read / files "
              f"(after): {(med(later) - med(made)) / max(1e-9, med(files[1:] or files) - med(made)):.2f}")
        print(f"  memory   notebook RSS growth with the {kind} touched: {med(growth[f'{kind} bound']):.2f} GiB "
              f"(the value: {mib / 1024:.2f} GiB; goal: no more than the value)")


