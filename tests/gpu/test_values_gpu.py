"""Notebook CUDA values on a real GPU (issue 15, items 1 and 2), through taas.session.Session
directly (the GPU machine has no Jupyter packages): a notebook ``Net().cuda()`` with tied
weights and a big CUDA tensor with a view of it, read by a 1-rank NCCL job, arrive on
``cuda:LOCAL_RANK`` with their storages shared (the big one through shared memory); the results
come back on the CPU, or on ``cuda:0`` with ``--results-device keep``.

Self-contained (no fixtures of tests/gpu/conftest.py needed); skipped without CUDA.  The same
rules are tested as data on CPU in tests/unit/job/test_devices.py."""

from __future__ import annotations

import textwrap

import pytest

from tests.gpu.harness import Recorder

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NOTEBOOK = textwrap.dedent("""
    import torch, torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.head = nn.Linear(64, 1000, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("scale", torch.ones(64))

        def forward(self, x):
            return self.head(self.embed(x) * self.scale)

    model = Net().cuda()
    base = torch.arange(1 << 20, dtype=torch.float32, device="cuda")  # 4 MiB: through shared memory
    view = base[10:]
""")

CELL = textwrap.dedent("""
    import os, torch
    local = int(os.environ["LOCAL_RANK"])
    places = {str(t.device) for t in (*model.parameters(), *model.buffers(), base, view)}
    report = dict(
        local=local, current=torch.cuda.current_device(), places=sorted(places),
        tied=model.head.weight is model.embed.weight,
        shared=view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(),
        equal=bool(torch.equal(view[:5].cpu(), torch.arange(10, 15, dtype=torch.float32))),
        shared_fds=os.environ.get("TAAS_SHARED_FDS", ""),
    )
    trained = model
    model(torch.arange(4, device=f"cuda:{local}"))
""")


@pytest.fixture
def notebook(tmp_path, monkeypatch):
    """A Session and the notebook's namespace (its classes are __main__'s, as in a kernel)."""
    from taas.session import Session

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(NOTEBOOK, "<notebook>", "exec"), namespace)
    session = Session()
    yield session, namespace
    session.close()


def _run(session, namespace, options: str):
    from taas import directive

    sink = Recorder()
    result = session.run_cell(CELL, namespace, directive.parse_options(options), sink=sink)
    return result, sink.text


def test_notebook_cuda_values_land_on_the_ranks_device_and_results_on_cpu(notebook):
    session, namespace = notebook
    result, shown = _run(session, namespace, "--gpus 1")
    report = result.values["report"]
    assert report["places"] == [f"cuda:{report['local']}"] == [f"cuda:{report['current']}"], (report, shown)
    assert report["tied"] and report["shared"] and report["equal"], report
    assert report["shared_fds"], "the big CUDA tensor went through shared memory, by descriptor"
    trained = result.values["trained"]
    assert {str(p.device) for p in trained.parameters()} == {"cpu"}
    assert trained.head.weight is trained.embed.weight and trained.scale.device.type == "cpu"
    assert result.has_out and result.out.device.type == "cpu"
    # the notebook's own values stay where they were
    assert namespace["model"].embed.weight.device.type == "cuda" and namespace["base"].is_cuda


def test_results_device_keep_brings_them_back_on_cuda(notebook):
    session, namespace = notebook
    result, shown = _run(session, namespace, "--gpus 1 --results-device keep")
    trained = result.values["trained"]
    assert {str(p.device) for p in trained.parameters()} == {"cuda:0"}, shown
    assert trained.head.weight is trained.embed.weight
    assert result.out.device == torch.device("cuda", 0)
