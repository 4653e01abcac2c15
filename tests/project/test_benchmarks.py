"""Every benchmark script imports (its names resolve), though the suite never runs one: a
benchmark that breaks when code moves should fail here, not the next time someone measures."""

from __future__ import annotations

import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "benchmarks").rglob("*.py") if path.name != "__init__.py")


def test_there_are_benchmarks():
    assert "benchmarks.launch" in MODULES and len(MODULES) >= 8


@pytest.mark.parametrize("module", MODULES)
def test_a_benchmark_imports(module):
    importlib.import_module(module)
