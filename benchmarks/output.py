"""Output cost: a long line without a newline, printed by a rank through taas and by the kernel
itself, side by side in one real Jupyter kernel; then many ranks printing the same lines.

    python benchmarks/output.py [--sizes 10,20,40] [--repeat 3] [--ranks 32] [--lines 10000]

For each size (MB of text, no newline): the median wall time of a plain cell that writes it
(the kernel printing it itself), of a ``%%taas --gpus 1`` cell that writes it, and of an empty
``%%taas --gpus 1`` cell (the launch, which the "taas - launch" column takes off).  Times run
from sending the cell to having received all of its output, as a notebook front end does.
Printed: the times and the ratio (taas - launch) / kernel.  The cost must stay linear in the
size: the ratio about the same for every size, within a small factor of 1.

Then ``--ranks`` ranks each printing the same ``--lines`` lines (``epoch N done``), which taas
shows once each, tagged ``[rank0-31]``: the wall time of that ``%%taas --gpus 32`` cell, of an
empty one (the launch), and of a plain cell printing the lines once, for half and all of
``--lines`` (the cost must be linear: the ratio about the same for both).  ``--ranks 0`` skips it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITE = "import sys\nsys.stdout.write('x' * {n})\nsys.stdout.flush()\n"
LINES = "for i in range({n}):\n    print(f'epoch {{i}} done')\n"


def timed(kernel, code: str, expect: int) -> float:
    started = time.perf_counter()
    run = kernel.run(code)
    wall = time.perf_counter() - started
    if run.error is not None or run.status != "ok":
        raise RuntimeError(f"the cell failed: {run.stderr}{run.traceback}")
    got = run.stdout.count("x")
    if got != expect:
        raise RuntimeError(f"expected {expect} characters, got {got}")
    return wall


def timed_lines(kernel, code: str, lines: int, ranks: int) -> tuple[float, int]:
    """Wall time of a cell printing ``lines`` lines on each of ``ranks`` ranks (0: the kernel
    itself), and how many lines the cell showed."""
    from tests.support.ranks import per_rank

    started = time.perf_counter()
    run = kernel.run(code)
    wall = time.perf_counter() - started
    if run.error is not None or run.status != "ok":
        raise RuntimeError(f"the cell failed: {run.stderr}{run.traceback}")
    shown = run.stdout.count("\n")
    got = per_rank(run.stdout).count(" done\n") if ranks > 1 else run.stdout.count(" done\n")
    if got != lines * max(ranks, 1):
        raise RuntimeError(f"expected {lines} lines from each of {ranks} ranks, got {got} in all")
    return wall, shown


def many_ranks(kernel, ranks: int, lines: int, repeat: int) -> None:
    """``ranks`` ranks printing the same lines, against the kernel printing them once."""
    taas = f"%%taas --gpus {ranks}\n"
    timed_lines(kernel, taas + LINES.format(n=1), 1, ranks)  # warm up
    launch = statistics.median(timed_lines(kernel, taas + "pass", 0, ranks)[0] for _ in range(repeat))
    print(f"\n{ranks} ranks printing the same lines; empty %%taas --gpus {ranks} cell (launch): {launch:.2f} s")
    print(f"{'lines':>6} {'kernel s':>9} {'taas s':>8} {'taas - launch s':>16} {'ratio':>6} {'shown lines':>12}")
    for n in (lines // 2, lines):
        kernel_s, taas_s, shown = [], [], 0
        for _ in range(repeat):  # interleaved, so that load affects both alike
            kernel_s.append(timed_lines(kernel, LINES.format(n=n), n, 0)[0])
            wall, shown = timed_lines(kernel, taas + LINES.format(n=n), n, ranks)
            taas_s.append(wall)
        k, t = statistics.median(kernel_s), statistics.median(taas_s)
        print(f"{n:>6} {k:>9.2f} {t:>8.2f} {t - launch:>16.2f} {(t - launch) / k:>6.1f} {shown:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,20,40", help="MB of text per run (default 10,20,40)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=32, help="ranks printing the same lines (0: skip)")
    parser.add_argument("--lines", type=int, default=10000, help="lines each rank prints")
    args = parser.parse_args()
    from tests.support.kernel_driver import Kernel

    sizes = [int(s) for s in args.sizes.split(",") if s]  # --sizes "": only the many ranks
    with tempfile.TemporaryDirectory() as cwd:
        kernel = Kernel(cwd)
        try:
            timed(kernel, "%%taas --gpus 1\n" + WRITE.format(n=1), 1)  # warm up
            if not sizes:
                many_ranks(kernel, args.ranks, args.lines, args.repeat)
                return
            launch = statistics.median(
                timed(kernel, "%%taas --gpus 1\n" + WRITE.format(n=0), 0) for _ in range(args.repeat))
            print(f"empty %%taas --gpus 1 cell (launch): {launch:.2f} s")
            print(f"{'MB':>4} {'kernel s':>9} {'taas s':>8} {'taas - launch s':>16} {'ratio':>6}")
            for mb in sizes:
                n = mb * 10**6
                kernel_s, taas_s = [], []
                for _ in range(args.repeat):  # interleaved, so that load affects both alike
                    kernel_s.append(timed(kernel, WRITE.format(n=n), n))
                    taas_s.append(timed(kernel, "%%taas --gpus 1\n" + WRITE.format(n=n), n))
                k, t = statistics.median(kernel_s), statistics.median(taas_s)
                print(f"{mb:>4} {k:>9.2f} {t:>8.2f} {t - launch:>16.2f} {(t - launch) / k:>6.2f}")
            if args.ranks:
                many_ranks(kernel, args.ranks, args.lines, args.repeat)
        finally:
            kernel.shutdown()


if __name__ == "__main__":
    main()
