"""Helpers of the data-plane tests (tests/unit/data/...): unit structures and their equality,
a job's shared-memory names, a cleanup hook run as the launcher runs it, and reading a socket to its end.  Test modules
import these from here, never from one another (the ``registered`` fixture is in
tests/unit/data/conftest.py)."""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import subprocess
import sys

import numpy as np
import torch


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


def structures() -> list:
    """One of each collated structure a loader may yield (spec section 5)."""
    return [
        (torch.arange(12.0).view(3, 4), torch.tensor([1, 2, 3])),
        [torch.zeros(0), torch.tensor(5), torch.ones(2, 3, dtype=torch.bool)],
        {"x": torch.randn(4, 5).t(), "label": 3, "name": "cat", "meta": {"ids": [1, 2], "f": 0.5}},
        Point(torch.arange(6, dtype=torch.int16), "y"),
        Sample(torch.full((2, 2), 7, dtype=torch.uint8), 9),
        (np.arange(10, dtype=np.float32).reshape(2, 5), np.array(["a", "bc"]), np.float64(2.5)),
        torch.randn(3, dtype=torch.complex64),
        torch.randn(4, 4).to(torch.bfloat16),
        torch.ones(3, requires_grad=True),
        ("strings only", 1, None, b"bytes"),
    ]


def same(a, b) -> bool:
    """``b`` is equal to ``a`` in structure, types, dtypes, shapes and values."""
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach()))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and same(dataclasses.astuple(a), dataclasses.astuple(b))
    return type(a) is type(b) and a == b


def job_shm(job_id: str) -> list[str]:
    """Every /dev/shm name that starts with ``taas-<job_id>-`` (a test's job has one attempt)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"taas-{job_id}-")]


def run_hook(hook) -> None:
    """Run a cleanup hook as the launcher does: in another process, imported by name."""
    code = ("import importlib, pickle, sys; entry, args = pickle.load(sys.stdin.buffer); "
            "m, _, f = entry.partition(':'); getattr(importlib.import_module(m), f)(*args)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(hook), env=env, check=True, timeout=120)


def read_to_end(sock) -> bytes:
    """Every byte a peer sends on ``sock`` until it closes (or resets) the connection."""
    sock.settimeout(60)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
