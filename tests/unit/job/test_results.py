"""Rank 0's results, both ends (taas.job.results): what rank 0 collects and encodes is what the
kernel decodes and loads; a value that cannot travel costs that value and one note."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import threading

import pytest
import torch

from taas.job import results


def _round_trip(namespace, bound, out=None, to_cpu=True) -> results.CellResult:
    sent = results.collect(namespace, bound, out, to_cpu=to_cpu)
    return results.load(results.decode(results.encode(sent)))


class Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling here\nsecond line")


class ExitsWhenPickled:
    def __reduce__(self):
        raise SystemExit(3)


def _refuse():
    raise ValueError("not in this kernel")


class FailsInTheKernel:
    """Pickles fine; unpickling it raises (as a user's __setstate__ may)."""

    def __reduce__(self):
        return _refuse, ()


def test_names_and_out_round_trip():
    namespace = {"x": 1, "s": "text", "d": {"a": [1, 2]}, "t": torch.arange(4)}
    got = _round_trip(namespace, ("x", "s", "d", "t"), out=("out", 2))
    assert set(got.values) == {"x", "s", "d", "t"}
    assert got.values["x"] == 1 and got.values["s"] == "text" and got.values["d"] == {"a": [1, 2]}
    assert torch.equal(got.values["t"], torch.arange(4))
    assert got.has_out and got.out == ("out", 2) and got.notes == ()


def test_no_last_expression_is_no_out_but_a_falsy_one_is_carried():
    assert not _round_trip({}, (), out=None).has_out
    got = _round_trip({}, (), out=0)
    assert got.has_out and got.out == 0


def test_dunders_and_names_the_cell_deleted_are_left_out_without_a_note():
    got = _round_trip({"__x__": 1, "y": 2}, ("__x__", "y", "gone"))
    assert got.values == {"y": 2} and got.notes == ()


def test_a_value_that_cannot_be_pickled_is_skipped_with_a_note_and_the_rest_come_back():
    namespace = {"lock": threading.Lock(), "bad": Unpicklable(), "ok": 5}
    got = _round_trip(namespace, ("lock", "bad", "ok"))
    assert got.values == {"ok": 5}
    assert len(got.notes) == 2
    lock_note, bad_note = got.notes
    assert lock_note.startswith("taas: `lock` was not brought back: lock cannot be pickled (")
    assert bad_note == "taas: `bad` was not brought back: Unpicklable cannot be pickled (no pickling here)"


def test_systemexit_while_pickling_costs_that_value_only():
    got = _round_trip({"e": ExitsWhenPickled(), "ok": 1}, ("e", "ok"))
    assert got.values == {"ok": 1}
    assert got.notes == ("taas: `e` was not brought back: ExitsWhenPickled cannot be pickled (SystemExit: 3)",)


def test_an_out_that_cannot_be_pickled_is_a_note():
    got = _round_trip({}, (), out=Unpicklable())
    assert not got.has_out
    assert got.notes == ("taas: the cell's result was not brought back: Unpicklable cannot be pickled "
                         "(no pickling here)",)


def test_a_value_that_fails_to_unpickle_in_the_kernel_costs_that_value_only():
    got = _round_trip({"f": FailsInTheKernel(), "ok": 1}, ("f", "ok"), out=FailsInTheKernel())
    assert got.values == {"ok": 1} and not got.has_out
    assert got.notes == ("taas: `f` was not brought back: ValueError: not in this kernel",
                         "taas: the cell's result was not brought back: ValueError: not in this kernel")


def test_a_value_nested_too_deeply_is_a_note():
    deep: list = []
    for _ in range(40_000):
        deep = [deep]
    got = _round_trip({"deep": deep}, ("deep",))
    assert got.values == {}
    assert got.notes == ("taas: `deep` was not brought back: list is nested too deeply to pickle",)


def _fake_ddp():
    """A class with DistributedDataParallel's qualified name: crossing knows wrappers by name."""
    cls = type("DistributedDataParallel", (), {"__module__": "torch.nn.parallel.distributed"})
    wrapper = cls()
    wrapper.module = torch.nn.Linear(2, 1)
    return wrapper


def test_a_ddp_wrapper_comes_back_as_the_module_it_wraps():
    got = _round_trip({"model": _fake_ddp()}, ("model",), out=_fake_ddp())
    assert type(got.values["model"]) is torch.nn.Linear
    assert type(got.out) is torch.nn.Linear


def test_to_cpu_keeps_containers_and_leaves_named_tuples_and_dict_subclasses_alone():
    Pair = collections.namedtuple("Pair", "a b")
    ordered = collections.OrderedDict(t=torch.ones(2))
    namespace = {"l": [torch.ones(1), (torch.zeros(1),)], "p": Pair(1, 2), "o": ordered}
    got = _round_trip(namespace, ("l", "p", "o"))
    assert isinstance(got.values["l"], list) and isinstance(got.values["l"][1], tuple)
    assert got.values["p"] == Pair(1, 2) and type(got.values["o"]) is collections.OrderedDict


def test_results_are_a_frozen_value_and_encode_as_one():
    sent = results.collect({"x": 1}, ("x",), 2, to_cpu=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sent.out = None  # type: ignore[misc]
    assert results.decode(results.encode(sent)) == sent


@pytest.mark.parametrize("data, what", [
    (b"not a pickle", "UnpicklingError"),
    (pickle.dumps({"values": {}, "skipped": {}, "out": None}), "a dict"),
])
def test_bytes_that_are_not_results_cost_the_names_not_the_job(data, what):
    got = results.load(results.decode(data))
    assert got.values == {} and not got.has_out
    assert got.notes == (f"taas: nothing was brought back: rank 0's results could not be read ({what})",)


# -- which names come back: what the analysis saw, and every name bound at run time -----------
class Plain:
    pass


def test_every_name_the_cell_bound_comes_back_however_bound_and_read_names_do_not():
    read, rebound, mutated = torch.zeros(2), Plain(), [1]
    namespace = {"__name__": "__main__", "Plain": Plain, "read": read, "rebound": rebound,
                 "mutated": mutated, "n": 5, "same": "x"}
    before = results.Before(namespace)
    exec("exec('by_exec = 1')\nglobals()['by_globals'] = 2\nfrom os.path import join\n"
         "rebound = Plain()\nmutated.append(2)\nread.add_(1)\nn = n + 1\n__dunder__ = 3\n"
         "same = 'x'", namespace)
    # "same" is bound by the cell as the analysis saw (the same object: it comes back all the
    # same); "gone" was deleted; read and mutated in place: not brought back.
    assert before.bound(namespace, static=["same", "gone"]) == [
        "same", "rebound", "n", "by_exec", "by_globals", "join"]


def test_a_value_freed_and_its_address_reused_still_counts_as_rebound():
    namespace = {"x": [1], "t": Plain()}
    before = results.Before(namespace)
    del namespace["x"], namespace["t"]
    namespace["x"], namespace["t"] = [2], Plain()  # may well sit where the old ones did
    assert before.bound(namespace) == ["x", "t"]
    kept = {"t": None}
    assert results.Before(kept).bound(kept) == []  # None is held, not weakly: unchanged


def test_before_holds_no_strong_reference_to_what_takes_a_weak_one():
    import gc
    import weakref

    value = Plain()
    probe = weakref.ref(value)
    namespace = {"v": value}
    before = results.Before(namespace)
    del value
    namespace["v"] = 1
    gc.collect()
    assert probe() is None and before.bound(namespace) == ["v"]
