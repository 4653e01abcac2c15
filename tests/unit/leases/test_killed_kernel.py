"""A SIGKILLed kernel never leaves a GPU leased: a process playing the kernel leases a (fake)
GPU, starts a rank on taas's local launcher with the lease's files and lets go of its own
copy, as the session does; the rank holds the lease; SIGKILL the kernel, and the guard ends
the start process and the rank, and the lease with them.  One start process (imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys

from taas.leases import locks
from tests.support.processes import is_alive, wait_for

KERNEL = r"""
import sys, time
from taas.launch.api import LaunchSpec, OutputChunk, ProcessSpec
from taas.launch.local.launcher import LocalLauncher
from taas.leases import locks
from taas.leases.api import Holder

path, cwd = sys.argv[1], sys.argv[2]
lease = locks.try_take(path, ["GPU-a"], Holder("kernel-job", "me"))
launcher = LocalLauncher()
job = launcher.start(LaunchSpec(
    job_id="k1", cwd=cwd, shared_fds=lease.fds,
    processes=(ProcessSpec(key="rank0", entry="tests.support.launch_targets:show_gpus_then_hang",
                           env=lease.env()),)))
lease.close()  # the rank holds it now
out = b""
while b"\n" not in out:
    for event in job.events(0.1):
        if isinstance(event, OutputChunk):
            out += event.data
print("RANK", job.pids["rank0"], out.decode().strip(), flush=True)
time.sleep(3600)
"""


def test_a_killed_kernel_leaves_no_gpu_leased(tmp_path):
    path = str(tmp_path / "leases")
    locks.ensure(path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, path, str(tmp_path)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None
        line = kernel.stdout.readline().split()  # the event: its rank runs
        assert line[:1] == ["RANK"], kernel.stderr.read() if kernel.poll() is not None else line
        rank = int(line[1])
        assert line[2:] == ["GPU-a", "-", "1"]  # the rank sees the leased GPU and holds one shared fd
        assert set(locks.held(path)) == {"GPU-a"}
        kernel.kill()
        kernel.wait()
        wait_for(lambda: not is_alive(rank), timeout=60, what="the rank's end after its kernel's")
        assert locks.held(path) == {}
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
