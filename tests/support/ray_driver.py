"""A kernel-less driver for tests/cluster/test_ray_launcher.py: runs cells on a Ray cluster through
:class:`taas.session.Session`, and prints what it saw as one JSON line per scenario.

Run inside the cluster's network and PID namespace (``nsenter``), so pids it reports and checks
are the ranks' own:  ``python -m tests.support.ray_driver ADDRESS WORKDIR``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from taas import directive
from taas.errors import JobFailed, LaunchError
from taas.launch.ray import launcher as ray_launcher
from taas.session import Session
from tests.support.kernel_driver import is_alive, wait_until_gone

started: list = []  # every RayJob of this driver, to check its processes are gone afterwards
_start = ray_launcher.RayLauncher.start


def _recording_start(self, spec):
    job = _start(self, spec)
    started.append(job)
    return job


ray_launcher.RayLauncher.start = _recording_start


class Recorder:
    """A sink that keeps every line and, the first time output containing ``seen`` arrives,
    calls ``then()`` (a scenario's move while the job runs: mark a file the rank waits for,
    kill an agent, report the job's pids)."""

    def __init__(self, seen: str = "", then=None):
        self.lines: list[str] = []
        self.seen, self.then = seen, then

    def write(self, stream: str, text: str) -> None:
        self.lines.extend(text.splitlines())
        if self.then is not None and self.seen in text:
            then, self.then = self.then, None
            then()

    def progress(self, key, stream, text, final) -> None:
        self.lines.append(text)


def leftovers() -> list[int]:
    """Pids of processes of the jobs this driver ran that still exist."""
    return [pid for job in started for pid in job._pids.values() if is_alive(pid)]


def run(session, source, line, sink=None):
    sink = sink or Recorder()
    out = {"lines": sink.lines}
    began = time.monotonic()
    try:
        result = session.run_cell(source, {}, directive.parse_options(line), sink=sink)
        out["values"] = {k: repr(v) for k, v in result.values.items()}
    except (JobFailed, LaunchError) as exc:
        out["error"] = type(exc).__name__
        out["summary"] = str(exc)
    out["wall_s"] = time.monotonic() - began
    out["exit_codes"] = session.last.exit_codes if session.last else {}
    deadline = time.monotonic() + 10
    while leftovers() and time.monotonic() < deadline:  # a start process reaps its children
        time.sleep(0.05)
    out["leftovers"] = leftovers()
    return out


ENV_CELL = """
import os, torch, torch.distributed as dist
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "MASTER_ADDR", "TAAS_NODE_ID", "TORCHELASTIC_USE_AGENT_STORE")
print("ENV", {k: os.environ.get(k) for k in keys})
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
total = t.item()
backend = dist.get_backend()
"""

LIVE_CELL = """
import os, time
print("first line", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists({mark!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
print("second line" if os.path.exists({mark!r}) else "the kernel never saw the first line")
"""

FAIL_CELL = """
import os, torch, torch.distributed as dist
if dist.get_rank() == 1:
    raise ValueError("boom on rank 1")
dist.barrier()
"""

RESTART_CELL = """
import os
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and os.environ["RANK"] == "1":
    raise RuntimeError("first attempt fails")
done = attempt
"""

LOADER_CELL = """
count = 0
while len(loader):
    for batch in loader:
        count += 1
print("COUNT", count)
"""


def loader_run(session):
    """A registered loader with two workers: placed on the rank nodes (no CPU-only node)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    import taas

    class Numbers(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            if i == 0:
                import os
                print("WORKER_NODE", os.environ.get("TAAS_NODE_ID"), flush=True)
            return torch.tensor([float(i)])

    loader = DataLoader(Numbers(), batch_size=2)
    taas.register(loader)
    try:
        sink = Recorder()
        session.run_cell(LOADER_CELL, {"loader": loader}, directive.parse_options("--gpus 2 --cpus 2 --units 8"),
                         sink=sink)
        return {"lines": sink.lines, "leftovers": leftovers()}
    finally:
        taas.unregister(loader)


HANG_CELL = """
import time
print("hanging", flush=True)
time.sleep(600)
"""


def orphan(address: str, workdir: str) -> None:
    """Start a job that hangs, print its processes' pids (and the agents'), and wait to be
    killed: the test kills this driver and checks that the cluster ends them all."""
    os.chdir(workdir)
    session = Session()
    session.use_cluster(address)
    launcher = session.launcher_for(address)
    agents = [i["pid"] for i in launcher._describe(launcher.nodes()).values()]
    sink = Recorder("hanging", lambda: print("PIDS " + json.dumps(agents + list(started[-1]._pids.values())),
                                               flush=True))
    run(session, HANG_CELL, "--gpus 2", sink)


def wait_gone(pids: list[int], timeout: float) -> None:
    print("LEFT " + json.dumps(wait_until_gone(pids, timeout)), flush=True)


def main() -> None:
    if sys.argv[1] == "--orphan":
        return orphan(sys.argv[2], sys.argv[3])
    if sys.argv[1] == "--wait-gone":
        return wait_gone(json.loads(sys.argv[2]), float(sys.argv[3]))
    address, workdir = sys.argv[1], sys.argv[2]
    os.chdir(workdir)
    session = Session()
    report = {}
    try:
        report["describe"] = session.use_cluster(address)
        report["env"] = run(session, ENV_CELL, "--gpus 2")
        report["warm"] = [run(session, ENV_CELL, "--gpus 2")["wall_s"] for _ in range(5)]
        mark = os.path.join(workdir, "seen-first-line")
        report["live"] = run(session, LIVE_CELL.format(mark=mark), "--gpus 2",
                             Recorder("first line", lambda: open(mark, "w").close()))
        report["fail"] = run(session, FAIL_CELL, "--gpus 2")
        report["restart"] = run(session, RESTART_CELL, "--gpus 2 --max-restarts 1")
        report["too_many"] = run(session, ENV_CELL, "--gpus 3")
        report["loader"] = loader_run(session)

        # An agent that dies: its ranks end as killed (-9), the job stops, nothing is left.
        launcher = session.launcher_for(address)
        agents = launcher._describe(launcher.nodes())
        def kill_agents():
            for info in agents.values():
                os.kill(info["pid"], signal.SIGKILL)

        report["agent_death"] = run(session, HANG_CELL, "--gpus 2", Recorder("hanging", kill_agents))
        report["after_agent_death"] = run(session, ENV_CELL, "--gpus 2")
        report["agent_pids"] = [i["pid"] for i in launcher._describe(launcher.nodes()).values()]
    except Exception:  # broad: the test shows whatever went wrong
        report["crash"] = traceback.format_exc()
    finally:
        session.close()
    time.sleep(0)  # nothing to wait for: close() returned after the agents ended
    report["agents_alive_after_close"] = [p for p in report.get("agent_pids", []) if is_alive(p)]
    report["leftovers_after_close"] = leftovers()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
