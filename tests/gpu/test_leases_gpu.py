"""GPU leases on a real GPU (issue 22): two notebooks (two processes, each its own Session, as
two kernels would be; the GPU machine has no Jupyter) each run ``--gpus 1`` on a one-GPU
machine.  The second waits, showing the line that names the first's job, and runs once the
first's rank has ended: never both on the GPU at once.  ``taas jobs``' GPU lines (NVML's real
inventory) show the lease while the first runs.  Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from taas.leases import inventory
from taas.leases.wait import machine_lines

NOTEBOOK = r'''
import sys
from taas import directive
from taas.session import Session

class Sink:  # every line and every state of the in-place lines, as they come
    def write(self, stream, text):
        print(text, end="", flush=True)
    def progress(self, key, stream, text, final):
        print(f"PROGRESS {key} {'final' if final else 'open'}: {text}", flush=True)

session = Session()
try:
    session.run_cell(sys.argv[1], {}, directive.parse_options("--gpus 1"), sink=Sink())
    print("CELL DONE", flush=True)
finally:
    session.close()
'''

CELL = '''
import os, time, torch
x = torch.ones(1024, 1024, device="cuda")  # on the GPU for the whole cell
name = os.path.join({folder!r}, {name!r})
open(name + ".started", "w").write(f"{{time.time()}} {{os.environ['CUDA_VISIBLE_DEVICES']}}")
while not os.path.exists(name + ".go"):
    time.sleep(0.05)
open(name + ".ended", "w").write(str(time.time()))
'''


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 240.0):
    deadline = time.monotonic() + timeout  # a bound only a failure reaches
    while not predicate():
        assert proc.poll() is None or predicate(), f"{what}: the notebook process ended"
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.05)


def _notebook(folder: str, name: str, out: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", NOTEBOOK, textwrap.dedent(CELL.format(folder=folder, name=name))],
                            cwd=folder, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT)


def test_the_second_notebook_waits_with_the_line_then_runs_never_both_on_the_gpu(tmp_path):
    folder = str(tmp_path)
    # Not about GPUs busy outside taas: the CUDA memory earlier tests of this pytest process
    # keep must not make the GPU "busy" for the notebooks.
    env = dict(os.environ, TAAS_LEASE_DIR=str(tmp_path / "leases"), TAAS_GPU_BUSY_MIB=str(1 << 30))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    a_out, b_out = str(tmp_path / "a.out"), str(tmp_path / "b.out")
    a = _notebook(folder, "a", a_out, env)
    b = None
    try:
        _wait_for(lambda: os.path.exists(tmp_path / "a.started"), "the first job's rank started", a)
        started_a, visible_a = open(tmp_path / "a.started").read().split()
        lines = machine_lines(inventory.gpus(), str(tmp_path / "leases"))
        assert any(visible_a in line and "leased by job" in line for line in lines), lines

        (tmp_path / "b.go").touch()  # the second cell ends as soon as it runs
        b = _notebook(folder, "b", b_out, env)
        _wait_for(lambda: "taas: waiting for 1 GPU(s), 0 free: GPU 0 leased by job" in open(b_out).read(),
                  "the second notebook's wait line", b)
        waiting = open(b_out).read()
        assert "1st in line" in waiting, waiting
        assert not os.path.exists(tmp_path / "b.started"), waiting  # it waits: nothing started

        (tmp_path / "a.go").touch()  # the first cell ends; its rank exits; the lease goes with it
        assert a.wait(timeout=240) == 0, open(a_out).read()
        assert b.wait(timeout=240) == 0, open(b_out).read()
        text = open(b_out).read()
        assert "CELL DONE" in text and "PROGRESS taas:gpus final: taas: waited " in text, text
        ended_a = float(open(tmp_path / "a.ended").read())
        started_b, visible_b = open(tmp_path / "b.started").read().split()
        assert visible_b == visible_a  # the same (only) GPU, by UUID
        assert float(started_b) > ended_a  # never both on the GPU
        assert "CELL DONE" in open(a_out).read()
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
