"""A start process forked from a warm process (taas.launch.local.forkstart), with real processes:
the guard execs to be small, the start process runs jobs, the warm process's descriptors stay
its own, and its death (SIGKILL) leaves nothing."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import psutil

from tests.support.processes import wait_until_gone

# A warm process as a job host forked by its zygote is one: told so, preloaded, one thread.  It
# holds a pipe (standing for its channel to a kernel), starts a job whose rank prints and then
# hangs, and prints what the test checks; then waits to be killed.
WARM = textwrap.dedent("""
    import json, os, sys, time
    os.environ["TAAS_FORK_START"] = "1"
    from taas.launch.local import forkstart
    forkstart.preload()
    from taas.launch.api import LaunchSpec, OutputChunk, ProcessSpec
    from taas.launch.local.launcher import LocalLauncher
    held_r, held_w = os.pipe()
    launcher = LocalLauncher()
    forked = forkstart.may_fork()
    launcher.warm()
    spec = LaunchSpec(job_id="fs", cwd=os.getcwd(), processes=(
        ProcessSpec(key="rank0", entry="tests.support.launch_targets:ignore_sigterm"),))
    job = launcher.start(spec)
    seen = b""
    while b"ready" not in seen:
        for ev in job.events(0.05):
            if isinstance(ev, OutputChunk):
                seen += ev.data
    print(json.dumps({"forked": forked, "guard": launcher._proc.pid, "starter": launcher.starter_pid,
                      "rank": job.pids["rank0"], "held": os.fstat(held_w).st_ino,
                      "env": "TAAS_FORK_START" in os.environ}), flush=True)
    time.sleep(600)
""")


def _inodes(pid: int) -> set[int]:
    out = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.stat(f"/proc/{pid}/fd/{name}").st_ino)
        except OSError:
            pass
    return out


def test_a_warm_process_forks_a_small_guard_and_a_warm_start_process_that_end_with_it(tmp_path):
    root = str(pathlib.Path(__file__).resolve().parents[4])  # the repository: tests.support importable
    warm = subprocess.Popen([sys.executable, "-c", WARM], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root))
    try:
        facts = json.loads(warm.stdout.readline())
        assert facts["forked"] and not facts["env"]  # the flag is taken out once read
        guard, starter, rank = (psutil.Process(facts[k]) for k in ("guard", "starter", "rank"))
        assert guard.ppid() == warm.pid and starter.ppid() == guard.pid
        command = guard.cmdline()  # exec'd: a fresh small interpreter, isolated, without site
        assert command[1:4] == ["-I", "-S", "-c"] and "'taas.launch.local.guard'" in command[4]
        assert command[5:] == [str(starter.pid), str(warm.pid)]
        with open(f"/proc/{guard.pid}/maps") as maps:
            assert "libtorch" not in maps.read()  # the guard never holds torch
        with open(f"/proc/{starter.pid}/maps") as maps:
            assert "libtorch" in maps.read()  # the start process has it, without importing it
        for pid in (guard.pid, starter.pid, rank.pid):
            assert facts["held"] not in _inodes(pid)  # the warm process's descriptors stay its own
        os.kill(warm.pid, signal.SIGKILL)
        warm.wait()
        assert wait_until_gone([guard.pid, starter.pid, rank.pid]) == []
    finally:
        if warm.poll() is None:
            warm.kill()
            warm.wait()
