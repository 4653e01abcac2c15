"""``--detach`` on a Ray cluster (issue 21): what a detached cell costs there, cold and with the
kernel's warm spare host.

    python benchmarks/cluster_detach.py [--repeat 3] [--pause 30]      (as root, from the repo root)

Starts the simulated cluster of the tests (tests/support/cluster.py) and a kernel connected to it,
and prints, side by side in one run, for a trivial 2-rank cell:

- the same cell attached, warm (the kernel's node agents up): its wall time, median of --repeat;
- the first detached cell of the kernel: no spare yet, its host actor is made for it (it imports
  torch and starts node agents of its own); the cell returns once the ranks run;
- later detached cells, each after a pause of --pause s (the spare made after the last detached
  cell had time to warm) and back to back (each right after the last one's results landed, as
  Run All runs them: the spare may still be warming), median of --repeat each;
- each detached job's ``%taas attach`` until rank 0's results landed;
- a kept cell (``--keep``) on the kernel's own kept ranks, then on kept ranks of a ``--keep
  --detach`` job it adopted (``%taas attach``: its cells go to the host actor through its TCP
  door), after a --kept-pause s pause and back to back, median of --kept-cells each (one after
  the other, not interleaved: either set of ranks holds the simulated cluster's GPUs).

The goal of the spare: a detached cell on the cluster within seconds, not the 16-18 s of a cold host.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.cluster import SimulatedCluster, missing_requirements

CELL = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nanswer = int(t.item())"


def _timed(kernel, code: str, expect: str | None = None) -> tuple[float, str]:
    started = time.perf_counter()
    run = kernel.run(code)
    took = time.perf_counter() - started
    if run.error is not None or (expect is not None and expect not in run.stdout):
        raise RuntimeError(f"the cell failed:\n{code}\n{run.stdout}{run.stderr}{run.traceback}")
    return took, run.stdout


def _detached(kernel) -> tuple[float, float]:
    """A detached cell's wall time, and its %taas attach until the results landed."""
    took, out = _timed(kernel, f"%%taas --gpus 2 --detach --fresh\n{CELL}", " detached: ")
    job = re.search(r"job ([0-9a-f]{6}) detached", out).group(1)
    attached, _ = _timed(kernel, f"%taas attach {job}")
    _timed(kernel, "assert answer == 2")
    _timed(kernel, f"%taas forget {job}")
    return took, attached


def _kept(kernel, cells: int, pause: float) -> dict[str, list[float]]:
    """Kept cells on the kernel's own kept ranks, then on kept ranks it adopted (one after the
    other: the ranks of one hold the cluster's GPUs)."""
    times: dict[str, list[float]] = {"own": [], "adopted": []}
    _timed(kernel, f"%%taas --gpus 2 --keep\n{CELL}")
    for _ in range(cells):
        time.sleep(pause)
        times["own"].append(_timed(kernel, f"%%taas\n{CELL}")[0])
    _timed(kernel, "%taas release")
    _, out = _timed(kernel, f"%%taas --gpus 2 --keep --detach --fresh\n{CELL}", " detached: ")
    job = re.search(r"job ([0-9a-f]{6}) detached", out).group(1)
    while "kept" not in _timed(kernel, "%taas jobs")[1].split(job, 1)[1].split("\n", 1)[0]:
        time.sleep(0.2)  # its first cell still running
    _timed(kernel, f"%taas attach {job}", "are this notebook's now")
    for _ in range(cells):
        time.sleep(pause)
        times["adopted"].append(_timed(kernel, f"%%taas\n{CELL}")[0])
    _timed(kernel, "%taas release")
    _timed(kernel, f"%taas forget {job}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pause", type=float, default=30.0)
    parser.add_argument("--kept-cells", type=int, default=10)
    parser.add_argument("--kept-pause", type=float, default=1.0)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(f"cannot start the simulated cluster: {reason}")
    cluster = SimulatedCluster().start()
    try:
        with tempfile.TemporaryDirectory() as cwd:
            kernel = cluster.kernel(cwd)
            try:
                _timed(kernel, f"%taas cluster {cluster.address}")
                attached = f"%%taas --gpus 2\n{CELL}"
                _timed(kernel, attached)  # warm-up: the kernel's agents are up
                warm = statistics.median(_timed(kernel, attached)[0] for _ in range(args.repeat))
                cold, cold_attach = _detached(kernel)
                paused, back = [], []
                for _ in range(args.repeat):
                    time.sleep(args.pause)
                    paused.append(_detached(kernel))
                for _ in range(args.repeat):
                    back.append(_detached(kernel))
                kept = {pause: _kept(kernel, args.kept_cells, pause) for pause in (args.kept_pause, 0.0)}
            finally:
                kernel.run("%taas cluster local")
                kernel.shutdown()
    finally:
        cluster.stop()
    med = statistics.median
    print(f"  cluster detach, 2-rank trivial cell: attached (warm) {warm:.2f} s")
    print(f"    first detached cell (cold host) {cold:.2f} s, its attach {cold_attach:.2f} s")
    print(f"    after a {args.pause:g} s pause (the spare warm), median of {args.repeat}: detached cell "
          f"{med(t for t, _ in paused):.2f} s, attach {med(a for _, a in paused):.2f} s")
    print(f"    back to back, median of {args.repeat}: detached cell {med(t for t, _ in back):.2f} s, "
          f"attach {med(a for _, a in back):.2f} s")
    print(f"  ratio  warm spare / cold host = {med(t for t, _ in paused) / cold:.3f}; "
          f"back to back / cold host = {med(t for t, _ in back) / cold:.3f}")
    for pause, times in kept.items():
        label = f"after a {pause:g} s pause" if pause else "back to back"
        print(f"  kept cell, {label}, median of {args.kept_cells}: the kernel's own kept ranks "
              f"{med(times['own']):.3f} s | adopted (--keep --detach) {med(times['adopted']):.3f} s | "
              f"ratio adopted / own = {med(times['adopted']) / med(times['own']):.2f}")


if __name__ == "__main__":
    main()
