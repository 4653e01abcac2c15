"""A name that referred to a registered loader and was assigned again gets a note (registry.rebound)."""

from __future__ import annotations

import pytest

from taas.data import registry
from taas.session import _rebound_loaders


class Loader:
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.fixture
def ns():
    namespace = {"loader": Loader(3)}
    registry.register(namespace["loader"])
    registry.remember_names(namespace)
    yield namespace
    for item in list(registry._entries.values()):
        registry.unregister(item.loader)


def test_the_registered_loader_itself_gets_no_note(ns):
    assert registry.rebound(ns, {"loader"}) == []


def test_a_name_assigned_again_gets_one_note_once(ns):
    ns["loader"] = Loader(5)
    notes = registry.rebound(ns, {"loader", "other"})
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "`loader` is no longer the loader registered" in notes[0]
    assert "plain value" in notes[0] and "taas.register(loader)" in notes[0]
    assert registry.rebound(ns, {"loader"}) == []  # the same replacement is noted once
    ns["loader"] = Loader(6)
    assert len(registry.rebound(ns, {"loader"})) == 1  # a new one is noted again


def test_no_note_when_the_cell_does_not_read_it_or_the_new_one_is_registered(ns):
    ns["loader"] = Loader(5)
    assert registry.rebound(ns, {"x"}) == []
    registry.register(ns["loader"])
    assert registry.rebound(ns, {"loader"}) == []


def test_no_note_after_assigning_the_registered_loader_back(ns):
    original = ns["loader"]
    ns["loader"] = Loader(5)
    ns["loader"] = original
    assert registry.rebound(ns, {"loader"}) == []


def test_a_name_bound_after_registering_is_remembered_when_a_cell_runs():
    plain = Loader(2)
    registry.register(plain)  # registered without a name
    try:
        namespace = {"data": plain}
        assert _rebound_loaders(namespace, {"data": plain}) == []
        namespace["data"] = Loader(4)
        notes = _rebound_loaders(namespace, {"data": namespace["data"]})
        assert len(notes) == 1 and "`data`" in notes[0]
    finally:
        registry.unregister(plain)


def test_a_function_that_reads_a_rebound_name_gets_the_note(ns):
    exec("def batches():\n    return list(loader)\n", ns)
    ns["loader"] = Loader(5)
    notes = _rebound_loaders(ns, {"batches": ns["batches"]})
    assert len(notes) == 1 and "`loader`" in notes[0]
