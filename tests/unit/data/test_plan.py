"""Unit numbering and the registry, as data: no processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from taas.data import registry
from taas.data.plan import Plan, default_prefetch, mix, resolve_units, share
from taas.errors import DirectiveError, RegistrationError


@pytest.mark.parametrize("workers, ranks", [(1, 1), (1, 2), (2, 2), (3, 2), (4, 2), (2, 4), (3, 3), (6, 4)])
def test_every_unit_has_exactly_one_channel(workers, ranks):
    plan = Plan(units=100, workers=workers, ranks=ranks, prefetch=10)
    pairs = plan.pairs()
    assert len(set(pairs)) == len(pairs)
    used = {(plan.producer(u), plan.consumer(u)) for u in range(plan.units)}
    assert used == set(pairs)  # no channel without traffic, none missing
    assert sorted(u for w in range(workers) for u in plan.worker_units(w)) == list(range(100))
    assert sorted(u for r in range(ranks) for u in plan.rank_units(r)) == list(range(100))
    for rank in range(ranks):
        assert {plan.producer(u) for u in plan.rank_units(rank)} == set(plan.workers_of(rank))
    assert sum(plan.prefetch_of(w) for w in range(workers)) == 10


@pytest.mark.parametrize("start, end, rank, ranks, expected", [
    (0, 10, 0, 2, 5), (0, 10, 1, 2, 5), (0, 9, 0, 2, 5), (0, 9, 1, 2, 4),
    (9, 18, 0, 2, 4), (9, 18, 1, 2, 5), (5, 5, 0, 3, 0), (5, 4, 0, 3, 0),
    (0, 1, 1, 2, 0), (3, 4, 1, 2, 1), (0, 100, 2, 3, 33),
])
def test_share_of_a_pass(start, end, rank, ranks, expected):
    assert share(start, end, rank, ranks) == expected
    assert expected == sum(1 for u in range(start, end) if u % ranks == rank)


def test_units_default_to_one_pass_and_a_loader_without_len_needs_units():
    assert resolve_units(None, 12, "train") == 12
    assert resolve_units(30, 12, "train") == 30
    assert resolve_units(30, None, "stream") == 30
    with pytest.raises(DirectiveError) as info:
        resolve_units(None, None, "stream")
    message = str(info.value)
    assert "`stream`" in message and "--units K" in message and "\n" not in message


@pytest.mark.parametrize("units, ranks, workers, asked, expected", [
    (100, 2, 2, None, 10), (5, 2, 2, None, 2), (1, 4, 1, None, 1), (1000, 2, 4, None, 100),
    (100, 2, 2, 7, 7), (100, 2, 2, 1000, 100), (0, 2, 2, None, 0),
])
def test_default_prefetch(units, ranks, workers, asked, expected):
    assert default_prefetch(units, ranks, workers, asked) == expected


def test_seeds_are_stable_and_distinct():
    # Stable: the same in a fresh interpreter (another hash seed, other addresses) as here,
    # and the values splitmix64 gives: seeding with the golden gamma is its state 0, whose
    # first output is 0xE220A8397B1DCDAF (63 bits kept).
    values = [(1, 2), (7, 0, 5), (), (2**64 + 1, 2), (-1,)]
    code = ("from taas.data.plan import mix\n"
            f"print([mix(*v) for v in {values!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([mix(*v) for v in values])
    assert mix(1, 2) == 327095433057816640
    assert mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF & (2**63 - 1)
    assert mix(2**64 + 1, 2) == mix(1, 2)  # 64-bit words
    seeds = {mix(7, p) for p in range(1000)} | {mix(7, 0, u) for u in range(1000)}
    assert len(seeds) == 2000
    assert all(0 <= s < 2**63 for s in seeds)


# -- registry --------------------------------------------------------------------------------
class Holder:
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return iter(range(3))


class Unpicklable:
    def __iter__(self):
        return iter(())

    def __reduce__(self):
        return (_fail, ())


def _fail():
    raise RuntimeError("cannot rebuild")


@pytest.fixture
def clean_registry():
    yield
    registry._entries.clear()


def test_register_checks_and_bookkeeping(clean_registry):
    data = [1, 2, 3]
    assert not registry.is_registered(data)
    registry.register(data)
    assert registry.is_registered(data) and registry.registered() == [object.__repr__(data)]
    with pytest.raises(RegistrationError, match="already registered"):
        registry.register(data)
    registry.unregister(data)
    assert not registry.is_registered(data) and registry.registered() == []
    with pytest.raises(RegistrationError, match="not registered"):
        registry.unregister(data)
    registry.register(data, prefetch=4, buffer_mb=8)
    assert registry.entry(data).prefetch == 4 and registry.entry([1, 2, 3]) is None


@pytest.mark.parametrize("value, message", [
    (5, "not iterable"),
    ((i for i in range(3)), "iterator"),
    (iter([1, 2]), "iterator"),
    (Holder(threading.Lock()), "`loader.inner` is _thread.lock"),
    (Holder({"ok": 1, "fh": threading.Lock()}), "`loader.inner['fh']` is _thread.lock"),
    (Unpicklable(), "does not unpickle"),
])
def test_register_refuses_what_cannot_work(clean_registry, value, message):
    with pytest.raises(RegistrationError) as info:
        registry.register(value)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not registry.is_registered(value)


def test_register_options_are_checked(clean_registry):
    with pytest.raises(RegistrationError, match="prefetch"):
        registry.register([1], prefetch=0)
    with pytest.raises(RegistrationError, match="buffer_mb"):
        registry.register([1], buffer_mb=-1)


def test_get_worker_info(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert registry.get_worker_info() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = registry.get_worker_info()
    assert info == registry.WorkerInfo(id=1, num_workers=4) and info.id == 1 and info.num_workers == 4


def test_import_taas_stays_cheap():
    code = ("import sys, taas; f = taas.register; assert callable(f); "
            "assert 'torch' not in sys.modules, 'torch'; assert 'IPython' not in sys.modules; "
            "print(taas.WorkerInfo(0, 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "WorkerInfo(id=0, num_workers=1)"
