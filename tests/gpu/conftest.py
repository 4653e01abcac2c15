"""The GPU suite's harness (fixtures for every module of tests/gpu).

Without CUDA every test here is marked skipped at collection, before any fixture runs: CI and
CPU machines collect the folder and report it skipped (never "no tests", exit code 5).

Fixtures:
    session     one :class:`taas.session.Session` (this machine's launcher) per module, whose
                notebook working directory is a fresh temporary folder; closed after the module.
    run         ``run(source, options="--gpus 1", namespace=None) -> CellRun``
                (:mod:`tests.gpu.harness`): the cell as ``%%taas OPTIONS``; ``.values``,
                ``.out``, ``.lines``/``.text`` (what the cell showed), ``.error`` (the one
                exception the notebook would raise, or None), ``.ok()`` asserts no error.
    clean       after the test: no job process left (within 5 s), no /dev/shm entry of the
                test's jobs, and GPU 0's memory back where it was before (the ranks' contexts
                and tensors freed).  Use it in every test that runs a job.
    gpu_baseline  GPU 0's used bytes before the test (what ``clean`` compares with), measured
                after this process opened its own CUDA context (the notebook's kernel may
                use CUDA; tests that allocate here free it before they end).

Helpers to import: ``from tests.gpu.harness import cell, notebook, run_cell, gpu_used_bytes``.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.gpu import harness

HERE = pathlib.Path(__file__).resolve().parent


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Without CUDA, skip this folder's tests (only these: the hook sees the whole session)."""
    if _cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the GPU suite runs on a GPU machine (docs/gpu.md)")
    for item in items:
        if HERE in pathlib.Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """One Session per module, run from a temporary notebook directory."""
    from taas.session import Session

    workdir = tmp_path_factory.mktemp("notebook")
    before = os.getcwd()
    saved = {k: os.environ.get(k) for k in harness.OFFLINE}
    os.environ.update(harness.OFFLINE)
    os.chdir(workdir)
    s = Session()
    try:
        yield s
    finally:
        s.close()
        os.chdir(before)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def run(session):
    def run(source: str, options: str = "--gpus 1", namespace: dict | None = None) -> harness.CellRun:
        return harness.run_cell(session, source, options, namespace)
    return run


@pytest.fixture
def gpu_baseline() -> int:
    """GPU 0's used bytes before the test, this process's own CUDA context included (opened
    here if it was not: a notebook that uses CUDA; once open it stays, so opening it first
    keeps it out of what the job is charged with).  A test that allocates on the GPU in this
    process frees it (``del``, ``torch.cuda.empty_cache()``) before it ends."""
    import torch

    torch.cuda.mem_get_info(0)
    torch.cuda.synchronize()
    return harness.gpu_used_bytes()


@pytest.fixture
def clean(session, gpu_baseline):
    """The test's jobs leave nothing behind: processes, /dev/shm, GPU memory."""
    first = len(session.job_ids)
    yield
    jobs = session.job_ids[first:]
    left = harness.leftovers(jobs)
    assert left == {"processes": {}, "shm": []}, left
    above = harness.gpu_returns_to(gpu_baseline)
    assert above <= 256 << 20, f"GPU 0 holds {above / 2**20:.0f} MiB more than before the job"
