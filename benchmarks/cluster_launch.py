"""A trivial 4-rank job over 2 nodes: taas on a Ray cluster against Ray Train's TorchTrainer.

    python benchmarks/cluster_launch.py [--repeat 5]      (as root, from the repo root)

Starts the simulated cluster of the tests (tests/support/cluster.py: a head, two "GPU" nodes with 2
GPUs each, a CPU node, in a private network and PID namespace) and runs a driver inside it that
measures, side by side in one run:

- taas cold: the first cell after connecting (``ray.init``, the node agents start, their start
  processes import torch), through :class:`taas.session.Session` with the Ray launcher;
- taas warm, back to back: later cells (fresh ranks every time) each started as soon as the
  last one returned, as Run All runs them; median of --repeat;
- taas warm, after a pause: the same with 1 s between cells (a person reads, then runs the
  next), median of --repeat;
- taas kept (``--keep``): a first cell starts the ranks and keeps them, then the same trivial
  cell on those kept ranks back to back and after a 1 s pause, median of --repeat each (no
  placement group and no processes started: the ranks, their GPUs and their process group stay);
- of each warm cell, the time spent reserving the GPUs (the placement group: see
  taas/launch/ray/reservation.py for why back to back once cost 0.5-0.7 s more);
- Ray Train: ``TorchTrainer(train_fn, ScalingConfig(num_workers=4)).fit()`` for the same job
  (init the process group, one all_reduce), cold every time, as Ray Train is.

The job: 4 ranks (2 per GPU node), gloo (the nodes have no CUDA), one all_reduce.  Ratios are
printed against Ray Train (goal for warm, back to back as after a pause: <= 0.02).  Needs
``ray[train]`` for the comparison; where the venv lacks it, ``pip install --no-deps --target DIR
pandas pyarrow tensorboardX`` and ``PYTHONPATH=DIR`` work (the driver and the cluster's nodes
inherit PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.cluster import SimulatedCluster, missing_requirements

DRIVER = r'''
import json, sys, tempfile, time
from taas.directive import JobOptions, parse_options
from taas.launch.ray import reservation
from taas.launch.ray.launcher import RayLauncher
from taas.session import Session

address, repeat = sys.argv[1], int(sys.argv[2])
CELL = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 4.0"

class Quiet:
    def write(self, stream, text): pass
    def progress(self, *a, **k): pass

held = []  # seconds each cell spent in Reservation.hold (the GPUs' placement group)
hold = reservation.Reservation.hold
def timed_hold(self, *args):
    t0 = time.perf_counter()
    try:
        return hold(self, *args)
    finally:
        held.append(time.perf_counter() - t0)
reservation.Reservation.hold = timed_hold

session = Session(launcher=RayLauncher(address))
def taas_job():
    held.clear()
    t0 = time.perf_counter()
    session.run_cell(CELL, {}, JobOptions(gpus=4), sink=Quiet())
    return [time.perf_counter() - t0, sum(held)]

cold = taas_job()[0]
back = [taas_job() for _ in range(repeat)]  # each as soon as the last returned (Run All)
paused = []
for _ in range(repeat):
    time.sleep(1.0)  # a person reads the output, then runs the next cell
    paused.append(taas_job())

def kept_job(options="--gpus 4"):
    held.clear()
    t0 = time.perf_counter()
    session.run_cell(CELL, {}, parse_options(options), sink=Quiet())
    return [time.perf_counter() - t0, sum(held)]

kept_first = kept_job("--gpus 4 --keep")[0]  # starts the ranks (warm agents) and keeps them
kept_back = [kept_job() for _ in range(repeat)]
kept_paused = []
for _ in range(repeat):
    time.sleep(1.0)
    kept_paused.append(kept_job())
session.close()

def train_fn():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4.0

trainer_s = []
try:
    import ray
    from ray.train import RunConfig, ScalingConfig
    # The same cluster (session.close() ended taas's connection; without an address, fit()
    # would start a private local cluster instead and time that).
    ray.init(address=address, log_to_driver=False)
    from ray.train.torch import TorchTrainer
    for _ in range(2):
        t0 = time.perf_counter()
        TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=4, use_gpu=False),
                     run_config=RunConfig(storage_path=tempfile.mkdtemp())).fit()
        trainer_s.append(time.perf_counter() - t0)
except ImportError as exc:
    print(f"(no Ray Train: {exc})", file=sys.stderr)
print(json.dumps({"cold": cold, "back": back, "paused": paused, "kept_first": kept_first,
                  "kept_back": kept_back, "kept_paused": kept_paused, "trainer": trainer_s}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(f"cannot run a simulated cluster here: {reason}")
    cluster = SimulatedCluster().start()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            script = os.path.join(workdir, "driver.py")
            with open(script, "w") as f:
                f.write(DRIVER)
            run = cluster.run([sys.executable, script, cluster.address, str(args.repeat)], cwd=workdir,
                              capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))))
    finally:
        cluster.stop()
    if run.returncode != 0:
        sys.exit(f"the driver failed:\n{run.stderr[-3000:]}")
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    trainer = statistics.median(figures["trainer"]) if figures["trainer"] else None
    print("4 ranks over 2 nodes (gloo, one all_reduce), simulated cluster:")
    print(f"  {'taas cold (first cell after connecting)':<42} {figures['cold']:7.3f} s"
          + (f"   {figures['cold'] / trainer:.3f}x TorchTrainer.fit" if trainer else ""))
    print(f"  {'taas --keep, first cell (starts the ranks)':<42} {figures['kept_first']:7.3f} s")
    for name, label in (("back", "taas warm, back to back (Run All)"), ("paused", "taas warm, after a 1 s pause"),
                        ("kept_back", "taas kept, back to back (Run All)"),
                        ("kept_paused", "taas kept, after a 1 s pause")):
        cells = figures[name]
        median = statistics.median(c[0] for c in cells)
        reserve = statistics.median(c[1] for c in cells)
        print(f"  {label:<42} {median:7.3f} s   "
              + (f"{median / trainer:.4f}x TorchTrainer.fit (goal <= 0.02)   " if trainer else "")
              + f"median of {len(cells)}: {', '.join(f'{c[0]:.3f}' for c in cells)}; "
              f"reserving GPUs {reserve:.3f} s ({', '.join(f'{c[1]:.3f}' for c in cells)})")
    if trainer:
        print(f"  {'Ray Train TorchTrainer.fit':<42} {trainer:7.1f} s   "
              f"({', '.join(f'{t:.1f}' for t in figures['trainer'])})")
    else:
        print("  Ray Train not installed (pip install -e '.[bench]'): no comparison")
    back = statistics.median(c[0] for c in figures["back"])
    paused = statistics.median(c[0] for c in figures["paused"])
    print(f"  back to back / after a pause = {back / paused:.2f}   (goal: about 1)")
    kept_back = statistics.median(c[0] for c in figures["kept_back"])
    kept_paused = statistics.median(c[0] for c in figures["kept_paused"])
    print(f"  kept: back to back / after a pause = {kept_back / kept_paused:.2f}   (goal: about 1)")


if __name__ == "__main__":
    main()
