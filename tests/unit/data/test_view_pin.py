"""Registered loaders on CUDA ranks: the view's tensors land in pinned host memory (issue 15,
item 4).  On CPU, as data: the decision (only a CUDA rank pins, on its own GPU), the walk that
pins every tensor of a collated structure and keeps the structure, and a real view (forked
loader workers, shared memory) with a fake pin function: ``len(view)``, units and order are
unchanged.  ``tests/gpu/test_suite_gpu.py`` checks ``t.is_pinned()`` on a GPU."""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid

import numpy as np
import pytest
import torch

from taas import directive
from taas.data import loader_worker as worker
from taas.data.plane import DataPlane
from taas.data.view import LoaderView, Pinning, pinned, pinning_for
from tests.support.forks import exit_code, fork_job_process, no_leftover_children  # noqa: F401 (an autouse fixture)

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True)
class Frozen:
    image: torch.Tensor


class Marked(dict):
    """A dict subclass with an attribute of its own (as Hugging Face's BatchEncoding has)."""


@pytest.mark.parametrize("device, local_rank, expected", [
    ("cuda", 0, Pinning(0)),
    ("cuda", 3, Pinning(3)),  # the rank's own GPU, never cuda:0 for everyone
    ("cuda:5", 5, Pinning(5)),
    ("cpu", 0, None),
    ("cpu", 2, None),
    (None, 0, None),  # settings from a kernel that did not say: as before, no pinning
])
def test_only_a_cuda_rank_pins_on_its_own_gpu(device, local_rank, expected):
    assert pinning_for(device, local_rank) == expected


def fake_pin(calls):
    def pin(t):
        calls.append(t)
        return t.clone().add_(0)  # a new tensor, so the test can tell pinned from not
    return pin


def test_the_walk_pins_every_cpu_tensor_and_keeps_the_structure():
    calls = []
    marked = Marked(a=torch.ones(2))
    marked.extra = "kept"
    value = {
        "batch": (torch.arange(4), [torch.zeros(3), "label", 7, 2.5, None]),
        "point": Point(torch.ones(1), torch.full((2,), 2.0)),
        "sample": Sample(torch.ones(2, 2), 3),
        "frozen": Frozen(torch.ones(5)),
        "marked": marked,
        "array": np.arange(3),
        "bytes": b"xy",
    }
    out = pinned(value, fake_pin(calls))
    assert len(calls) == 7
    assert isinstance(out["batch"], tuple) and isinstance(out["batch"][1], list)
    assert out["batch"][1][1:] == ["label", 7, 2.5, None]
    assert type(out["point"]) is Point and torch.equal(out["point"].y, torch.full((2,), 2.0))
    assert type(out["sample"]) is Sample and out["sample"].label == 3
    assert type(out["frozen"]) is Frozen and out["frozen"] is not value["frozen"]
    assert type(out["marked"]) is Marked and out["marked"].extra == "kept"
    assert out["array"] is value["array"] and out["bytes"] == b"xy"
    originals = {id(t) for t in calls}
    leaves = [out["batch"][0], out["batch"][1][0], *out["point"], out["sample"].image,
              out["frozen"].image, out["marked"]["a"]]
    assert not any(id(t) in originals for t in leaves)  # every tensor went through pin
    assert value["sample"].image is calls[4] and value["marked"]["a"] is calls[6]  # input untouched


def test_the_real_pin_keeps_requires_grad_a_leaf(monkeypatch):
    from taas.data import view

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # no CUDA here
    t = torch.ones(3, requires_grad=True)
    p = view._pin_tensor(t)
    assert p.requires_grad and p.is_leaf and torch.equal(p.detach(), t.detach())


def run_view(data, options: str, pinning_of, device: str, tmp_path):
    """Every ``for`` of rank 0's view of ``data`` (lens and units), loader workers forked."""
    plane = DataPlane.plan({"data": data}, directive.parse_options(options), 1, device)
    plane.open(uuid.uuid4().hex[:12], "taas.data.shm.transport:ShmTransport")
    pids = []
    try:
        cfg = plane.settings["data"]
        pids = [fork_job_process(worker.main, spec, str(tmp_path)) for spec in plane.processes({})]
        view = LoaderView(cfg, 0, pinning_of(cfg))
        view._await_prefetch()
        passes = []
        while len(view):
            length = len(view)
            passes.append((length, [batch for batch in view]))
        view._close()
        assert [exit_code(pid) for pid in pids] == [0] * len(pids)
        pids = []
        return cfg, passes
    finally:
        for pid in pids:
            import os

            os.kill(pid, 9)
            os.waitpid(pid, 0)
        plane.close()


def test_a_cuda_ranks_view_pins_every_unit_with_len_units_and_order_unchanged(registered, tmp_path):
    data = registered([(torch.full((64, 64), float(i)), {"i": torch.tensor(i)}) for i in range(10)])
    options = "--gpus 1 --cpus 2 --units 25"  # 2.5 passes
    pins, threads = [], []

    def fake(cfg):
        decided = pinning_for(cfg["device"], 0)
        assert decided == Pinning(0)  # what install_views decides for this CUDA rank
        return Pinning(decided.device, tensor=fake_pin(pins),
                       thread=lambda device: threads.append((device, threading.current_thread().name)))

    cfg, passes = run_view(data, options, fake, "cuda", tmp_path)
    assert cfg["device"] == "cuda"
    _, plain = run_view(data, options, lambda cfg: None, "cpu", tmp_path)
    assert [(n, len(b)) for n, b in passes] == [(n, len(b)) for n, b in plain] == [(10, 10), (10, 10), (5, 5)]
    flat = [b for _, batches in passes for b in batches]
    assert [int(b[1]["i"]) for b in flat] == [u % 10 for u in range(25)]  # units, in order
    assert all(torch.equal(b[0], p[0]) for b, p in zip(flat, (b for _, bs in plain for b in bs)))
    assert len(pins) == 2 * 25  # each unit's two tensors, once
    assert threads == [(0, "taas-view-data")]  # the reader thread, once, on the rank's GPU


def test_a_cpu_ranks_view_does_not_pin(registered, tmp_path):
    data = registered([torch.full((3,), float(i)) for i in range(4)])
    cfg, passes = run_view(data, "--gpus 1 --cpus 1", lambda cfg: pinning_for(cfg["device"], 0), "cpu", tmp_path)
    assert cfg["device"] == "cpu" and pinning_for(cfg["device"], 0) is None
    assert [[t.tolist() for t in b] for _, b in passes] == [[[float(i)] * 3 for i in range(4)]]
