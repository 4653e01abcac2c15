"""Output cost: a long line without a newline, printed by a rank through taas and by the kernel
itself, side by side in one real Jupyter kernel.

    python benchmarks/output.py [--sizes 10,20,40] [--repeat 3]

For each size (MB of text, no newline): the median wall time of a plain cell that writes it
(the kernel printing it itself), of a ``%%taas --gpus 1`` cell that writes it, and of an empty
``%%taas --gpus 1`` cell (the launch, which the "taas - launch" column takes off).  Times run
from sending the cell to having received all of its output, as a notebook front end does.
Printed: the times and the ratio (taas - launch) / kernel.  The cost must stay linear in the
size: the ratio about the same for every size, within a small factor of 1.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,20,40", help="MB of text per run (default 10,20,40)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from tests.support.kernel_driver import Kernel

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as cwd:
        kernel = Kernel(cwd)
        try:
            timed(kernel, "%%taas --gpus 1\n" + WRITE.format(n=1), 1)  # warm up
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
        finally:
            kernel.shutdown()


if __name__ == "__main__":
    main()
