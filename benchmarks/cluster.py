"""The simulated Ray cluster the multi-machine tests use (tests/support/cluster.py): its cost.

    python benchmarks/cluster.py [--repeat 3] [--idle 10]     (as root, from the repo root)

Printed per run: seconds until every node is alive (start; a retried start counts whole),
seconds until a driver inside has connected and listed the nodes, the idle cluster's memory
(RSS summed, and PSS, which counts shared pages once) and its CPU use over --idle seconds, then
the seconds stop() takes.
Which interpreter runs it matters: every Ray process imports what its environment makes it
import (run it with the venv you want to measure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.cluster import SimulatedCluster, missing_requirements

DRIVER = ("import ray; ray.init(address='127.0.0.1:6379', log_to_driver=False); "
          "print(len(ray.nodes()))")


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # ended meanwhile: it used nothing more
            pass
    return total


def one_run(idle: float) -> dict:
    t0 = time.monotonic()
    cluster = SimulatedCluster().start()
    try:
        started = time.monotonic() - t0
        procs = cluster.processes()
        before = cpu_seconds(procs)
        time.sleep(idle)  # a measurement window, not a wait for readiness
        cpu = (cpu_seconds(procs) - before) / idle
        rss = pss = 0
        for p in procs:
            try:
                info = p.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            except psutil.Error:  # ended meanwhile
                pass
        t1 = time.monotonic()
        run = cluster.run([sys.executable, "-c", DRIVER], capture_output=True, text=True)
        driver = time.monotonic() - t1
        assert run.stdout.strip() == "4", run.stdout + run.stderr
    finally:
        t2 = time.monotonic()
        cluster.stop()
    return {"start_s": started, "driver_s": driver, "rss_mb": rss / 2**20, "pss_mb": pss / 2**20,
            "idle_cores": cpu, "procs": len(procs), "stop_s": time.monotonic() - t2,
            "retried": len(cluster.failures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--idle", type=float, default=10.0)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(f"cannot run a simulated cluster here: {reason}")
    print(f"python: {sys.executable}")
    runs = []
    for i in range(args.repeat):
        r = one_run(args.idle)
        runs.append(r)
        print(f"run {i + 1}: start {r['start_s']:.1f}s  driver {r['driver_s']:.1f}s  "
              f"{r['procs']} processes  RSS {r['rss_mb']:.0f} MB  PSS {r['pss_mb']:.0f} MB  "
              f"idle {r['idle_cores']:.2f} cores  stop {r['stop_s']:.1f}s"
              + (f"  (after {r['retried']} failed start)" if r["retried"] else ""), flush=True)
    starts = [r["start_s"] for r in runs]
    print(f"start: median {statistics.median(starts):.1f}s, min {min(starts):.1f}s, "
          f"max {max(starts):.1f}s over {len(runs)} runs")


if __name__ == "__main__":
    main()
