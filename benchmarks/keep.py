"""Kept ranks (``--keep``, issue 16): what a cell on ranks kept between cells costs.

    python benchmarks/keep.py [--ranks 4] [--repeat 10] [--big-mib 1024] [--cells 200]

Also run by ``benchmarks/launch.py`` (its last case), side by side with the rest.  Printed:

* a trivial 4-rank cell (an all_reduce and a print per rank: launch.TRIVIAL) through real
  Jupyter kernels, timed from execute_request to the reply, rounds interleaved: taas's warm
  cell on fresh ranks, taas's cell on kept ranks, and nbdistributed's cell on its persistent
  workers when it is installed (the goal: kept <= 0.25 x nbdistributed),
  and the same cell on kept ranks re-attached: started ``--keep --detach`` by a kernel since
  killed, adopted by a new one with ``%taas attach`` (issue 21's goal: <= 0.1 x nbdistributed);
  each after a pause and again at once (back to back);
* in one session, kept cells side by side: plain, and reading an unchanged ``--big-mib`` MiB
  notebook tensor the ranks already hold (what it adds; the goal: <= 0.01 s);
* ``--cells`` kept cells through a real kernel, back to back: the kernel's and each rank's
  RSS, open fds and threads after the first tenth and after the last (the goal: flat).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.launching.job import THINK_TIME
from benchmarks.launching.machine import wake_cost
from benchmarks.launching.kernels import NBD_VERSION, TRIVIAL, NbdKernel, timed
from benchmarks.launching.values import BIG_SAMPLE

NBD_REFERENCE = 0.12  # s: nbdistributed's trivial cell as issue 16 measured it on these machines


def _nbd_installed() -> bool:
    try:
        from importlib.metadata import version

        return version("nbdistributed") == NBD_VERSION
    except ImportError:  # PackageNotFoundError: not installed
        return False


def run_kept_kernels(ranks: int, repeat: int) -> None:
    """The trivial cell: fresh ranks, kept ranks (and nbdistributed), each THINK_TIME after the
    one before, after one untimed warm-up cell each."""
    from tests.support.kernel_driver import OFFLINE, Kernel

    expect = f"rank {ranks - 1} sum {ranks}"
    fresh_cell, kept_cell = f"%%taas --gpus {ranks}\n{TRIVIAL}", f"%%taas\n{TRIVIAL}"
    times: dict[str, list[float]] = {"fresh": [], "kept": [], "adopted": [], "nbd": [], "fresh0": [], "kept0": []}
    in_kernel = dict(OFFLINE, TAAS_ATTACHED_IN_HOST="0")  # the supervisor in the kernel, as before
    with tempfile.TemporaryDirectory() as cwd:
        fresh, kept, nbd = Kernel(cwd, env=OFFLINE), Kernel(cwd, env=OFFLINE), None
        fresh0, kept0 = Kernel(cwd, env=in_kernel), Kernel(cwd, env=in_kernel)
        adopted = None
        try:
            for k in (fresh, fresh0):
                timed(k, fresh_cell, expect)  # warm-up: the start process is up
            for k in (kept, kept0):
                timed(k, f"%%taas --gpus {ranks} --keep\n{TRIVIAL}", expect)  # the ranks stay
            adopted = _adopted_kernel(cwd, ranks, expect)
            rows = [("fresh", fresh, fresh_cell), ("kept", kept, kept_cell), ("adopted", adopted, kept_cell),
                    ("fresh0", fresh0, fresh_cell), ("kept0", kept0, kept_cell)]
            if _nbd_installed():
                nbd = NbdKernel(cwd, ranks)
                timed(nbd, TRIVIAL, expect)
                rows.append(("nbd", nbd, TRIVIAL))
            for _ in range(repeat):
                for name, kernel, code in rows:
                    time.sleep(THINK_TIME)
                    times[name].append(timed(kernel, code, expect))
                    # and at once again (Run All): no process has slept between the two cells
                    times.setdefault(f"{name}_b2b", []).append(timed(kernel, code, expect))
            timed(kept, "%taas release", "released the kept ranks")
            timed(kept0, "%taas release", "released the kept ranks")
            timed(adopted, "%taas release", "released the kept ranks")
        finally:
            for k in (fresh, kept, fresh0, kept0):
                k.shutdown()
            if adopted is not None:
                # Its ranks outlive the kernel (--keep --detach): released here too when a round
                # failed before the release above (then it says there are none), never left behind.
                try:
                    adopted.run("%taas release")
                finally:
                    adopted.shutdown()
            if nbd is not None:
                nbd.close()
    med = statistics.median
    line = (f"  keep   kernel trivial {ranks}-rank cell, median of {repeat}: taas fresh ranks "
            f"{med(times['fresh']):.3f} s | taas kept ranks {med(times['kept']):.3f} s | taas kept ranks "
            f"re-attached (--keep --detach, adopted by a new kernel) {med(times['adopted']):.3f} s")
    print(f"  keep   the same with the supervisor in the kernel (TAAS_ATTACHED_IN_HOST=0): fresh ranks "
          f"{med(times['fresh0']):.3f} s | kept ranks {med(times['kept0']):.3f} s; kernel's job host / in the "
          f"kernel: fresh {med(times['fresh']) / med(times['fresh0']):.3f}, kept "
          f"{med(times['kept']) / med(times['kept0']):.3f}")
    b2b = (f"  keep   the same, each cell again at once after it (back to back, Run All): taas fresh "
           f"{med(times['fresh_b2b']):.3f} s | kept {med(times['kept_b2b']):.3f} s | re-attached "
           f"{med(times['adopted_b2b']):.3f} s")
    if times["nbd"]:
        print(f"{line} | nbdistributed {med(times['nbd']):.3f} s (persistent workers)")
        print(f"{b2b} | nbdistributed {med(times['nbd_b2b']):.3f} s")
        for name in ("kept", "adopted"):
            print(f"  ratio  {name}/nbdistributed = {med(times[name]) / med(times['nbd']):.3f} after a "
                  f"{THINK_TIME:g} s pause, {med(times[name + '_b2b']) / med(times['nbd_b2b']):.3f} back to back"
                  "   (goal <= 0.1)")
    else:
        print(f"{line} | nbdistributed not installed (pip install .[bench])")
        print(b2b)
        for name in ("kept", "adopted"):
            print(f"  ratio  {name}/nbdistributed's {NBD_REFERENCE} s measured in issue 16 = "
                  f"{med(times[name]) / NBD_REFERENCE:.3f}   (goal <= 0.1; not side by side)")


def _adopted_kernel(cwd: str, ranks: int, expect: str):
    """Kept ranks that outlived the kernel that started them (``--keep --detach``, then that
    kernel killed), adopted by a new kernel with ``%taas attach``: that kernel, ready for cells."""
    import json
    import signal

    from tests.support.kernel_driver import OFFLINE, Kernel, wait_for, wait_until_gone

    env = dict(OFFLINE, TAAS_HOME=os.path.join(cwd, ".taas-home"), TAAS_WARM_HOST="1")
    starter = Kernel(cwd, env=env)
    try:
        run = starter.run(f"%%taas --gpus {ranks} --keep --detach\n{TRIVIAL}")
        if run.error is not None or " detached: " not in run.stdout:
            raise RuntimeError(f"the kept detached cell failed:\n{run.stdout}{run.stderr}{run.traceback}")
        job = run.stdout.split(" detached: ")[0].rsplit(" ", 1)[1]
        path = os.path.join(env["TAAS_HOME"], "jobs", job, "record.json")
        wait_for(lambda: json.load(open(path))["state"] == "kept", what="the first cell's end")
        os.kill(starter.pid, signal.SIGKILL)
        wait_until_gone([starter.pid])
    finally:
        starter.shutdown()
    adopter = Kernel(cwd, env=env)
    timed(adopter, f"%taas attach {job}", "are this notebook's now")
    timed(adopter, f"%%taas\n{TRIVIAL}", expect)  # warm-up, as for the others
    return adopter


def run_kept_big(ranks: int, repeat: int, mib: int) -> None:
    """Kept cells in one session, plain and reading ``big`` (which the ranks hold already: it
    went with the first kept cell), interleaved.  ``session.after_cell()`` runs where the kernel
    would run it, after each cell."""
    import torch

    from taas.directive import parse_options

    from benchmarks.launching.job import Collect, new_session

    session = new_session()
    namespace = {"big": torch.randn(mib << 18)}  # float32: mib MiB; one dict: the notebook's
    plain, big, made, bound = [], [], [], []
    # Rank 0 makes a mib MiB tensor: binds it (it comes back), or drops it (the floor).
    make = f"import torch.distributed as dist\nr = torch.ones({mib << 18}) if dist.get_rank() == 0 else None\n"

    def cell(source: str, options: str) -> float:
        started = time.perf_counter()
        session.run_cell(source, namespace, parse_options(options), sink=Collect())
        wall = time.perf_counter() - started
        session.after_cell()
        return wall

    try:
        cell(BIG_SAMPLE + TRIVIAL, f"--gpus {ranks} --device cpu --keep")  # big goes once, here
        for _ in range(repeat):
            for out, source in ((plain, TRIVIAL), (big, BIG_SAMPLE + TRIVIAL),
                                (made, make + "r = None\n" + TRIVIAL), (bound, make + TRIVIAL)):
                time.sleep(THINK_TIME)
                out.append(cell(source, ""))
    finally:
        session.release()
        session.close()
    med = statistics.median
    print(f"  keep   kept cell {med(plain):.4f} s | reading the unchanged {mib} MiB tensor {med(big):.4f} s "
          f"(median of {repeat})")
    print(f"  added  by the unchanged {mib} MiB tensor on kept ranks = {med(big) - med(plain):+.4f} s   (goal <= 0.01)")
    print(f"  added  by bringing a {mib} MiB result back from kept ranks (bound - made): first "
          f"{bound[0] - med(made):+.3f} s, after {med(bound[1:] or bound) - med(made):+.3f} s   (goal <= 0.5 per GiB)")


def _figures(proc) -> tuple[int, int, int]:
    """(RSS bytes, open fds, threads) of one process."""
    return proc.memory_info().rss, proc.num_fds(), proc.num_threads()


def run_kept_many(ranks: int, cells: int) -> None:
    """``cells`` kept cells back to back through a real kernel: resources after the first tenth
    (everything imported, caches warm) against after the last."""
    import psutil

    from tests.support.kernel_driver import OFFLINE, Kernel, process_name

    with tempfile.TemporaryDirectory() as cwd:
        kernel = Kernel(cwd, env=OFFLINE)
        try:
            kernel.run("import torch\nt = torch.ones(1024)")
            timed(kernel, f"%%taas --gpus {ranks} --keep\n{TRIVIAL}", f"rank {ranks - 1} sum")
            snaps = []
            for i in range(1, cells):
                # Each cell reads the notebook's tensor (unchanged: never sent again) and binds
                # a result (it comes back every cell).
                timed(kernel, f"%%taas\n{TRIVIAL}\ns = float(t.sum()) + {i}", f"rank {ranks - 1} sum")
                if i in (cells // 10, cells - 1):
                    procs = {"kernel": psutil.Process(kernel.pid)}
                    procs.update((process_name(p), p) for p in kernel.descendants()
                                 if process_name(p).startswith("taas-rank"))
                    snaps.append({name: _figures(p) for name, p in sorted(procs.items())})
            timed(kernel, "%taas release", "released the kept ranks")
        finally:
            kernel.shutdown()
    first, last = snaps
    print(f"  keep   {cells} kept cells: resources after cell {cells // 10} -> after cell {cells - 1} "
          "(goal: flat)")
    for name in first:
        (rss0, fds0, th0), (rss1, fds1, th1) = first[name], last.get(name, (0, 0, 0))
        print(f"         {name:8s} RSS {rss0 / 2**20:7.1f} -> {rss1 / 2**20:7.1f} MiB ({(rss1 - rss0) / 2**20:+.1f}) | "
              f"fds {fds0} -> {fds1} | threads {th0} -> {th1}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--big-mib", type=int, default=1024, help="0: skip the big-tensor case")
    parser.add_argument("--cells", type=int, default=200, help="0: skip the many-cells case")
    args = parser.parse_args()
    run_all(args.ranks, args.repeat, args.big_mib, args.cells)


def run_all(ranks: int, repeat: int, big_mib: int, cells: int) -> None:
    print(wake_cost())  # what the figures below depend on most, on this machine
    run_kept_kernels(ranks, repeat)
    if big_mib:
        run_kept_big(ranks, repeat, big_mib)
    if cells:
        run_kept_many(ranks, cells)


if __name__ == "__main__":
    main()
