"""Driving taas without a kernel, for the GPU suite (``tests/gpu``) and ``benchmarks/gpu.py``:
a :class:`Session` runs cells with a plain dict as the notebook's namespace, as the magics do,
and what a job leaves behind is checked with psutil and /dev/shm.

Nothing here imports jupyter_client or IPython: the GPU machine has neither.  Nothing here
initialises CUDA either, except :func:`gpu_used_bytes` when NVML cannot be read (the test
process is the notebook's kernel, which may use CUDA; the start process that forks ranks is a
fresh interpreter, never this one).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil

from taas import directive
from taas.errors import TaasError
from taas.session import JobStats, Session
from tests.support.notebooks import OFFLINE, cell  # noqa: F401 (the GPU tests import them from here)
from tests.support.processes import wait_until_gone


class Recorder:
    """A sink (:class:`taas.io.output.Sink`) that keeps every line the job shows."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, stream: str, text: str) -> None:
        self.lines.extend(text.splitlines())

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        if final:
            self.lines.append(text)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class CellRun:
    """One cell's job as the notebook would see it."""

    values: dict = field(default_factory=dict)  # the names rank 0 bound, brought back
    out: object = None  # rank 0's last expression
    lines: list[str] = field(default_factory=list)  # what the cell showed (rank-tagged when N > 1)
    error: TaasError | None = None  # the one exception the notebook would raise
    wall_s: float = 0.0
    stats: JobStats | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def ok(self) -> "CellRun":
        """This run, after asserting that it did not fail (the failure's text otherwise)."""
        assert self.error is None, f"{type(self.error).__name__}: {self.error}\n{self.text}"
        return self


def run_cell(session: Session, source: str, options: str = "--gpus 1",
             namespace: dict | None = None) -> CellRun:
    """Run ``source`` as ``%%taas OPTIONS`` would, with ``namespace`` as the notebook's names
    (results are set there, as in a notebook)."""
    namespace = {} if namespace is None else namespace
    sink = Recorder()
    began = time.monotonic()
    run = CellRun(lines=sink.lines)
    try:
        result = session.run_cell(cell(source), namespace, directive.parse_options(options), sink=sink)
        namespace.update(result.values)
        run.values, run.out = dict(result.values), result.out
    except TaasError as exc:
        run.error = exc
    run.wall_s = time.monotonic() - began
    run.stats = session.last
    return run


def notebook(source: str, **names) -> dict:
    """A notebook namespace after running ``source`` in it (as a plain cell would): functions
    and classes it defines belong to ``__main__``, so they travel by value like a notebook's."""
    namespace = {"__name__": "__main__", **names}
    exec(compile(cell(source), "<notebook cell>", "exec"), namespace)
    return namespace


# -- what a job leaves behind ------------------------------------------------------------------


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def job_processes() -> list[psutil.Process]:
    """This process's descendants that belong to a job: not the warm start process, its guard,
    or the idle children it forks ahead for the next job ("taas-ready")."""
    out = []
    for p in psutil.Process().children(recursive=True):
        if "taas.launch.local.starter" in _cmdline(p) or _name(p) in ("taas-start", "taas-ready"):
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        out.append(p)
    return out


def job_shm(job_ids) -> list[str]:
    """/dev/shm entries of the given jobs (``taas-<job>-...``)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if any(n.startswith(f"taas-{job}") for job in job_ids))


def leftovers(job_ids, timeout: float = 5.0) -> dict:
    """What the given jobs left after ``timeout`` seconds: processes (pid -> command line) and
    /dev/shm entries; both empty when everything ended as the spec says (within 5 s)."""
    gone = wait_until_gone([p.pid for p in job_processes()], timeout)
    deadline = time.monotonic() + timeout
    while job_shm(job_ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = {}
    for pid in gone:
        try:
            procs[pid] = _cmdline(psutil.Process(pid))
        except psutil.Error:
            pass
    return {"processes": procs, "shm": job_shm(job_ids)}


# -- GPU memory ----------------------------------------------------------------------------------
def gpu_used_bytes(index: int = 0) -> int:
    """Bytes in use on GPU ``index`` by every process: NVML when it can be read (no CUDA
    context in this process), else ``torch.cuda.mem_get_info`` (which opens one here)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or NVML unreadable here (a sandboxed driver): ask CUDA
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return int(total - free)


def gpu_returns_to(baseline: int, slack: int = 256 << 20, timeout: float = 10.0) -> int:
    """Wait until GPU 0's used memory is back within ``slack`` of ``baseline`` (the driver frees
    an exited process's memory a moment after it exits); the bytes still used above it."""
    deadline = time.monotonic() + timeout
    while True:
        above = gpu_used_bytes() - baseline
        if above <= slack or time.monotonic() > deadline:
            return max(above, 0)
        time.sleep(0.1)
