"""Jobs that outlive the kernel (``--detach``, issue 21): what detaching costs, and attaching.

    python benchmarks/detach.py [--ranks 4] [--repeat 7] [--lines 100000] [--line-ranks 8]

Printed, through real Jupyter kernels on this machine:

* the trivial 4-rank cell (launch.TRIVIAL), warm, attached and detached, rounds interleaved, with
  a pause before each cell of 10 s (the next job host is warm), of launch.THINK_TIME, and back to
  back (Run All): the
  attached cell's wall time; the detached cell's wall time (it returns once the ranks run) and
  its whole job (that cell, then ``%taas attach`` until rank 0's results landed); what detaching
  adds (the goal: <= 0.05 s);
* attaching to a running job whose ranks printed ``--lines`` lines (over ``--line-ranks``
  ranks): how long until the cell shows its latest lines and its rank panel (the goal: <= 1 s),
  and how much the attaching kernel's memory grew, beside the job's log on disk (the goal: less
  than the log).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.launching.job import THINK_TIME
from benchmarks.launching.machine import wake_cost
from benchmarks.launching.kernels import TRIVIAL, timed

WARM_PAUSE = 10.0  # s: time enough for the job host forked after a detached cell to be warm, however busy


def _job(run) -> str:
    line = [x for x in run.stdout.splitlines() if " detached: " in x]
    if run.error is not None or len(line) != 1:
        raise RuntimeError(f"the detached cell failed:\n{run.stdout}{run.stderr}{run.traceback}")
    return line[0].split("job ", 1)[1].split()[0]


def run_start(ranks: int, repeat: int) -> None:
    from tests.support.kernel_driver import OFFLINE, Kernel

    expect = f"rank {ranks - 1} sum {ranks}"
    attached, detached = f"%%taas --gpus {ranks}\n{TRIVIAL}", f"%%taas --gpus {ranks} --detach\n{TRIVIAL}"
    with tempfile.TemporaryDirectory() as cwd:
        env = dict(OFFLINE, TAAS_HOME=os.path.join(cwd, "home"), TAAS_WARM_HOST="1")
        kernel = Kernel(cwd, env=env)
        try:
            timed(kernel, attached, expect)  # warm-up: the start process is up
            warm = _job(kernel.run(detached))  # and a job host has run a job of this size
            kernel.run(f"%taas attach {warm}")
            time.sleep(10)  # the next job host (started after that job) is warm
            # The kernel's zygote forks the next job host 1 s after each detached cell
            # (spares.SETTLE); a detached cell that comes sooner (back to back) has one forked
            # for it then, and that shows in its time.
            for pause, label in ((WARM_PAUSE, f"after a {WARM_PAUSE:g} s pause (a warm job host)"),
                                 (THINK_TIME, f"after a {THINK_TIME:g} s pause"), (0.0, "back to back (Run All)")):
                times: dict[str, list[float]] = {"attached": [], "detached cell": [], "detached job": []}
                for _ in range(repeat):
                    time.sleep(pause)
                    times["attached"].append(timed(kernel, attached, expect))
                    time.sleep(pause)
                    started = time.perf_counter()
                    run = kernel.run(detached)
                    returned = time.perf_counter() - started
                    job = _job(run)
                    done = kernel.run(f"%taas attach {job}")
                    if done.error is not None or expect not in done.stdout:
                        raise RuntimeError(f"attach failed:\n{done.stdout}{done.stderr}{done.traceback}")
                    times["detached job"].append(time.perf_counter() - started)
                    times["detached cell"].append(returned)
                    kernel.run(f"%taas forget {job}")
                med = {name: statistics.median(values) for name, values in times.items()}
                print(f"  detach {ranks}-rank trivial cell, {label}, median of {repeat}: attached "
                      f"{med['attached']:.3f} s | detached: the cell {med['detached cell']:.3f} s, the "
                      f"whole job (cell + %taas attach to its results) {med['detached job']:.3f} s")
                print(f"  added  by detaching: {med['detached job'] - med['attached']:+.3f} s   (goal <= +0.05 s)")
        finally:
            kernel.shutdown()


def run_attach(lines: int, ranks: int) -> None:
    from tests.support.kernel_driver import OFFLINE, Kernel

    per_rank = lines // ranks
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as signals:
        home = pathlib.Path(cwd) / "home"
        # Outside the working directory: ranks other than 0 see that through their storage
        # layer, which may not show a file created there after they started.
        go = pathlib.Path(signals) / "go"
        env = dict(OFFLINE, TAAS_HOME=str(home), TAAS_WARM_HOST="1")
        starter = Kernel(cwd, env=env)
        try:
            run = starter.run(f"%%taas --gpus {ranks} --detach\n"
                              "import os, time, torch.distributed as dist\n"
                              "r = dist.get_rank()\n"
                              f"for i in range({per_rank}):\n"
                              "    print(f'rank {r} line {i} of the long log')\n"
                              "print(f'rank {r} printed all', flush=True)\n"
                              f"while not os.path.exists({str(go)!r}):\n"
                              "    time.sleep(0.05)\n")
            job = _job(run)
        finally:
            starter.shutdown()
        try:
            _attach_to(job, home, go, cwd, env, lines, ranks, Kernel)
        finally:
            go.touch()  # the job ends, whatever happened above


def _attach_to(job: str, home: pathlib.Path, go: pathlib.Path, cwd: str, env: dict, lines: int, ranks: int,
               kernel_class) -> None:
    """Once the job printed every line: a new kernel attaches; when it shows the latest lines
    and the panel, the job may end."""
    import psutil

    out = home / "jobs" / job / "out"
    deadline = time.monotonic() + 600
    while b"".join(p.read_bytes() for p in out.glob("*.jsonl")).count(b"printed all") < ranks:
        state = (home / "jobs" / job / "record.json").read_text()
        if time.monotonic() > deadline or '"state": "running"' not in state:
            raise RuntimeError(f"the job did not print its lines: {state}")
        time.sleep(0.2)
    time.sleep(2.5)  # the panel is drawn from 2 s into a job: let it exist before attaching
    log_bytes = sum(p.stat().st_size for p in out.glob("*.jsonl"))
    viewer = kernel_class(cwd, env=env)
    try:
        # What a notebook that trains has imported anyway (torch), and taas's own side: the
        # growth measured is the attach's.
        viewer.run("import torch, taas.session, taas.host.client")
        rss_before = psutil.Process(viewer.pid).memory_info().rss
        seen: dict[str, float] = {}
        started = time.perf_counter()

        def look(cell) -> None:
            if "latest" not in seen and "printed all" in cell.stdout:
                seen["latest"] = time.perf_counter() - started
            if cell.panels:
                seen.setdefault("panel", time.perf_counter() - started)
            if "latest" in seen and "panel" in seen:
                go.touch()  # the cell showed where the job is: let it end

        run = viewer.run(f"%taas attach {job}", on_output=look, on_panel=look)
        rss_after = psutil.Process(viewer.pid).memory_info().rss
        if run.error is not None:
            raise RuntimeError(run.traceback)
    finally:
        viewer.shutdown()
    print(f"  attach to a job that printed {lines:,} lines over {ranks} ranks (its log on disk "
          f"{log_bytes / 2**20:.1f} MiB): the latest lines shown after {seen.get('latest', float('nan')):.3f} s, "
          f"the rank panel after {seen.get('panel', float('nan')):.3f} s (goal <= 1 s); "
          f"{run.stdout.count(chr(10)):,} lines shown")
    print(f"  the attaching kernel's memory grew by {(rss_after - rss_before) / 2**20:.1f} MiB "
          f"(goal: less than the log's {log_bytes / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--line-ranks", type=int, default=8)
    parser.add_argument("--only", choices=("start", "attach"))
    args = parser.parse_args()
    print(wake_cost())  # what the figures below depend on most, on this machine
    if args.only in (None, "start"):
        run_start(args.ranks, args.repeat)
    if args.only in (None, "attach"):
        run_attach(args.lines, args.line_ranks)


if __name__ == "__main__":
    main()
