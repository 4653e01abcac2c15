"""The job every launch benchmark times, and the two ways to run it: torchrun, and a taas
:class:`~taas.session.Session` (cells without a kernel, as the magics run them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time


THINK_TIME = 1.0


def new_session(in_host: bool | None = None):
    """A Session as ``%load_ext taas`` makes one: its attached jobs in the kernel's job host
    (taas.host.remote) unless ``TAAS_ATTACHED_IN_HOST=0``; ``in_host`` says which, for a
    side-by-side run."""
    from taas.host.remote import KernelHost
    from taas.session import Session

    if in_host is None:
        in_host = os.environ.get("TAAS_ATTACHED_IN_HOST", "1") != "0"
    session = Session()
    if in_host:
        session.job_host = KernelHost()
    return session

BODY = textwrap.dedent(
    """
    import json, os, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend=BACKEND, init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for step in range(STEPS + 5):
        if step == 5:  # warm-up steps excluded
            started = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step_ms = (time.perf_counter() - started) / STEPS * 1000
    if dist.get_rank() == 0:
        print("STEP_MS", json.dumps(step_ms), flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(backend: str, steps: int) -> str:
    return f"BACKEND = {backend!r}\nSTEPS = {steps}\n" + BODY


def run_torchrun(script: str, ranks: int, tries: int = 3) -> tuple[float, float]:
    """One torchrun job, timed.  The free port is picked before torchrun binds it (torchrun's
    own way), so another process may take it meanwhile: such a run is retried."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    for attempt in range(tries):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
             "--master_addr=127.0.0.1", f"--master_port={free_port()}", script],
            env=env, capture_output=True, text=True,
        )
        wall = time.perf_counter() - started
        if done.returncode == 0:
            return wall, step_ms(done.stdout)
        print(f"  (torchrun failed, try {attempt + 1} of {tries}: {done.stderr.strip().splitlines()[-1:]})",
              file=sys.stderr)
    raise RuntimeError(f"torchrun failed {tries} times:\n{done.stderr[-2000:]}")


class Collect:
    def __init__(self):
        self.text = ""

    def write(self, stream, text):
        self.text += text

    def progress(self, *args, **kwargs):
        pass


def run_taas(session, source: str, ranks: int, device: str, namespace: dict | None = None) -> tuple[float, float]:
    from taas.directive import parse_options

    sink = Collect()
    started = time.perf_counter()
    session.run_cell(source, dict(namespace or {}), parse_options(f"--gpus {ranks} --device {device} --no-results"),
                     sink=sink)
    wall = time.perf_counter() - started
    return wall, step_ms(sink.text)


def step_ms(text: str) -> float:
    for line in text.splitlines():
        if "STEP_MS" in line:
            return json.loads(line.split("STEP_MS", 1)[1])
    raise RuntimeError(f"no STEP_MS in output:\n{text}")

