"""Launch overhead: the same 4-rank job started by torchrun and by taas, side by side.

The job: init the default process group (gloo on CPU, NCCL with --device cuda), one
all_reduce, then a small DDP training loop whose per-step time rank 0 reports.

    python benchmarks/launch.py [--ranks 4] [--repeat 3] [--steps 50]

Printed: median wall time of each way to start the job, and the ratios the project tracks
(taas cold / torchrun, taas warm / torchrun, per-step time taas / torchrun).  Then, in one
session, warm jobs side by side: plain, and reading a --big-mib notebook tensor (the time it
adds, and the job's peak memory with and without it; see _MemorySampler for how).  "cold" is a new
session whose start process is launched at the moment the cell runs (the worst case: in a
notebook ``%load_ext taas`` starts it in the background beforehand); "first" is the first cell of
a session made as ``%load_ext taas`` makes one, run LOAD_PAUSE seconds later (the extension's
background start has ended: what a person who loads it, then writes a cell, waits for); "warm"
is the next cell, run THINK_TIME seconds later (untimed), as a person would: the start process
uses that pause to fork the next job's processes ahead.

Then results back, in one session: warm jobs side by side whose rank 0 binds a --result-mib
tensor, or a model of that size, against the plain warm job and against the same job that makes
the value but does not bind it (what bringing it back adds), the first time and after, with the
notebook's RSS growth once it touched the value (run_results).

Last, a trivial 4-rank cell (an all_reduce and a print per rank) through real Jupyter kernels,
side by side: ``%%taas --gpus 4`` (fresh ranks every cell) against nbdistributed's cell on its
persistent workers, timed from execute_request to the reply; see run_kernels.  And the same
cell on kept ranks (``--keep``), a kept cell reading an unchanged notebook tensor, and many kept
cells' resources: benchmarks/keep.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.launching.job import THINK_TIME, body, new_session, run_taas, run_torchrun
from benchmarks.launching.kernels import run_kernels
from benchmarks.launching.values import run_big, run_results

LOAD_PAUSE = 15.0  # s: %load_ext's background start (the start process and the job host import torch) is over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--big-mib", type=int, default=1024,
                        help="size of the notebook tensor of the big-value case (0: skip it)")
    parser.add_argument("--result-mib", type=int, default=1024,
                        help="size of the value rank 0 binds in the results-back case (0: skip it)")
    parser.add_argument("--only-results", action="store_true", help="run only the results-back case")
    parser.add_argument("--kernel-repeat", type=int, default=10,
                        help="rounds of the trivial cell through real kernels, taas vs nbdistributed (0: skip)")
    parser.add_argument("--only-kernel", action="store_true", help="run only the real-kernel case")
    parser.add_argument("--keep-cells", type=int, default=200,
                        help="kept cells in the --keep case's resources run (benchmarks/keep.py; -1: skip the case)")
    args = parser.parse_args()
    if args.only_kernel:
        run_kernels(args.ranks, args.kernel_repeat)
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    source = body(backend, args.steps)
    if args.only_results:
        run_results(source, args.ranks, args.device, args.repeat, args.result_mib)
        return

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(source)
        torchrun, cold, first, warm, inkernel = [], [], [], [], []
        for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits all alike
            torchrun.append(run_torchrun(script, args.ranks))
            session = new_session()
            try:
                session.warm()  # as %load_ext does
                time.sleep(LOAD_PAUSE)  # untimed: the person writes the first cell
                first.append(run_taas(session, source, args.ranks, args.device))
            finally:
                session.close()
            session = new_session()
            try:
                cold.append(run_taas(session, source, args.ranks, args.device))
                time.sleep(THINK_TIME)  # untimed: a person reads the output, then runs the next cell
                warm.append(run_taas(session, source, args.ranks, args.device))
            finally:
                session.close()
            # The same warm job with the supervisor in the kernel (TAAS_ATTACHED_IN_HOST=0): what
            # the kernel's job host costs or saves.
            session = new_session(in_host=False)
            try:
                run_taas(session, source, args.ranks, args.device)
                time.sleep(THINK_TIME)
                inkernel.append(run_taas(session, source, args.ranks, args.device))
            finally:
                session.close()

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    print(f"{args.ranks} ranks, {backend}, {args.steps} DDP steps, median of {args.repeat} runs")
    print(f"  wall   torchrun {med(torchrun, 0):7.3f} s | taas cold {med(cold, 0):7.3f} s "
          f"| taas first after %load_ext and a {LOAD_PAUSE:g} s pause {med(first, 0):7.3f} s "
          f"| taas warm {med(warm, 0):7.3f} s")
    print(f"  step   torchrun {med(torchrun, 1):7.3f} ms | taas cold {med(cold, 1):7.3f} ms "
          f"| taas warm {med(warm, 1):7.3f} ms")
    print(f"  ratio  cold/torchrun = {med(cold, 0) / med(torchrun, 0):.3f}   (goal <= 0.5)")
    print(f"  ratio  warm/torchrun = {med(warm, 0) / med(torchrun, 0):.3f}   (goal <= 0.05)")
    print(f"  ratio  warm, supervisor in the kernel/torchrun = {med(inkernel, 0) / med(torchrun, 0):.3f}"
          f"   (job host / in the kernel = {med(warm, 0) / med(inkernel, 0):.3f})")
    step_ratio = statistics.median([w[1] for w in warm]) / med(torchrun, 1)
    print(f"  ratio  step taas/torchrun = {step_ratio:.3f}   (goal <= 1.03)")
    if args.big_mib:
        run_big(source, args.ranks, args.device, args.repeat, args.big_mib)
    if args.result_mib:
        run_results(source, args.ranks, args.device, args.repeat, args.result_mib)
    if args.kernel_repeat:
        run_kernels(args.ranks, args.kernel_repeat)
    if args.keep_cells >= 0:  # kept ranks (--keep), side by side in the same run
        from benchmarks.keep import run_all

        run_all(args.ranks, args.kernel_repeat or args.repeat, args.big_mib, args.keep_cells)


if __name__ == "__main__":
    main()
