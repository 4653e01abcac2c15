"""NCCL faults on a real GPU (issue 15, items 3 and 5), through :class:`taas.session.Session`:
the notebook's process uses CUDA before the job; an interrupt during a long NCCL collective
loop stops the job within 5 s (the ranks' SIGTERM aborts their process groups,
:mod:`taas.rank.nccl`); a failing NCCL rank ends its job; ``NCCL_DEBUG`` lines reach the cell;
the GPU is freed after each (the ``clean`` fixture of ``tests/gpu/conftest.py``).

Skipped without CUDA (the folder's conftest; and here, so this module stands alone too).  One
GPU: every job is ``--gpus 1`` (NCCL cannot put two ranks on one GPU).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU suite runs on a GPU machine", allow_module_level=True)

from tests.gpu import harness  # noqa: E402 (after the skip: the harness is the GPU suite's)

# A rank in a collective loop that never ends by itself; it says where it is through a file.
_LOOP = """
    import pathlib
    import torch
    import torch.distributed as dist
    t = torch.ones(64 * 2**20, device="cuda")  # 256 MiB per all_reduce
    pathlib.Path({marker!r}).touch()
    while True:
        for _ in range(100):
            dist.all_reduce(t)
        torch.cuda.synchronize()
    """


def _interrupt_when(path, timeout: float = 120.0) -> threading.Thread:
    """SIGINT this process (the kernel's Ctrl-C) once ``path`` exists, plus a moment."""
    main = threading.main_thread().ident

    def later() -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # well inside the loop
        _interrupt_when.sent = time.monotonic()
        signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    return thread


def test_the_kernel_uses_cuda_first_then_a_nccl_job_runs(run, clean):
    notebook_tensor = torch.ones(1024, device="cuda")  # the notebook's own CUDA context
    assert torch.cuda.is_initialized()
    r = run("""
        import torch
        import torch.distributed as dist
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        seen = (dist.get_backend(), str(t.device), float(t.sum()))
        """).ok()
    assert r.values["seen"] == ("nccl", "cuda:0", 4.0)
    del notebook_tensor
    torch.cuda.empty_cache()


def test_an_interrupt_during_an_nccl_collective_loop_stops_within_5_seconds(session, clean, tmp_path):
    marker = str(tmp_path / "in-the-loop")
    _interrupt_when(marker)
    began = time.monotonic()
    try:
        r = harness.run_cell(session, _LOOP.format(marker=marker))
    except KeyboardInterrupt:
        r = None
    ended = time.monotonic()
    assert os.path.exists(marker), "the rank never reached its loop"
    assert ended - began < 300
    stopped_in = ended - _interrupt_when.sent
    assert r is None or r.error is not None
    assert stopped_in <= 5.0, f"the interrupted NCCL job took {stopped_in:.1f} s to stop"
    # ``clean``: no process left (within 5 s), GPU memory back where it was.


def test_a_failing_nccl_rank_ends_its_job_promptly(run, clean):
    began = time.monotonic()
    r = run("""
        import torch
        import torch.distributed as dist
        t = torch.ones(64 * 2**20, device="cuda")
        for _ in range(50):
            dist.all_reduce(t)
        raise RuntimeError("the rank fails after its collectives")
        """)
    assert r.error is not None and "the rank fails after its collectives" in str(r.error) + r.text
    assert time.monotonic() - began < 60


def test_nccl_debug_lines_reach_the_cell(tmp_path, monkeypatch):
    """NCCL writes its log to the rank's stdout: the cell's output (tagged with the rank when
    the job has more than one).  A user's NCCL_DEBUG_FILE would send it elsewhere: dropped."""
    from taas import directive
    from taas.session import Session

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log"))
    monkeypatch.chdir(tmp_path)
    session = Session()  # a start process of its own, with this environment
    try:
        sink = harness.Recorder()
        session.run_cell("import torch, torch.distributed as dist\nt = torch.ones(1, device='cuda')\n"
                         "dist.all_reduce(t)", {}, directive.parse_options("--gpus 1"), sink=sink)
    finally:
        session.close()
    assert "NCCL INFO" in sink.text, sink.text[-2000:]
    assert not (tmp_path / "nccl.log").exists()
