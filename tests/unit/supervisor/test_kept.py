"""Kept ranks' bookkeeping: fingerprints (what need not be sent again), idle limits, release."""

import math
import threading
import time

import torch

from taas.job.api import World
from taas.supervisor.kept import Keeper, Kept, fingerprint


class FakeHandle:
    def __init__(self):
        self.stopped = self.closed = False

    def stop(self, grace=1.0):
        self.stopped = True

    def layers(self):
        return []

    def close(self):
        self.closed = True

    def memory(self):
        return {}

    def reserved(self):
        return None


class FakeLauncher:
    where = "this machine"


def kept(limit=math.inf):
    class Layers:
        def merge(self, *args):
            pass

    return Kept(FakeLauncher(), FakeHandle(), World(2, "cpu", "gloo"), "job", Layers(), limit)


def test_a_tensor_changed_in_place_or_rebound_is_sent_again():
    k, t = kept(), torch.zeros(3)
    k.remember("t", t)
    assert k.holds("t", t)
    t.add_(1)
    assert not k.holds("t", t)
    k.remember("t", t)
    assert k.holds("t", t)
    assert not k.holds("t", torch.zeros(3))  # rebound
    assert not k.holds("u", t)  # never shipped under that name


def test_a_module_whose_parameters_changed_is_sent_again():
    k, m = kept(), torch.nn.Linear(2, 1)
    k.remember("m", m)
    assert k.holds("m", m)
    with torch.no_grad():
        m.weight.add_(1)
    assert not k.holds("m", m)


def test_small_plain_values_compare_by_content_others_by_identity():
    k, xs = kept(), [1, 2]
    k.remember("xs", xs)
    xs.append(3)
    assert not k.holds("xs", xs)
    # Distinct objects with equal content: the same fingerprint; other content: another one.
    big, other = 10**30, int("1" + "0" * 30)
    assert big is not other and fingerprint(big) == fingerprint(other)
    a, b = {"lr": 0.1, "layers": [1, (2, "x")]}, {"lr": 0.1, "layers": [1, (2, "x")]}
    assert a is not b and fingerprint(a) == fingerprint(b)
    assert fingerprint([1, 2]) == fingerprint([1, 2]) != fingerprint([1, 3])
    assert fingerprint(big) != fingerprint(big + 1)
    assert fingerprint(a) != fingerprint({**a, "lr": 0.2})
    f = lambda: 1  # noqa: E731
    assert fingerprint(f) == ("id", id(f))


def test_a_new_object_at_a_freed_ones_address_is_not_taken_for_it():
    k = kept()

    class Box:
        pass

    k.remember("b", Box())  # freed at once: its weak reference dies
    assert not k.holds("b", Box())


def test_describe_and_flag():
    k = kept(limit=90)
    assert k.flag() == "--keep 90s" and kept().flag() == "--keep"
    line = k.describe()
    assert line.startswith("kept ranks: 2 on cpu/gloo on this machine, 0 cell(s), idle 0 s")
    assert "released after 90 s idle" in line
    assert "GPU memory" not in line  # the ranks said none (CPU ranks)
    k.gpu_mem.update({"rank1": 512 << 20, "rank0": 1 << 30})
    assert k.describe().endswith("; GPU memory (torch, after the last cell) rank0 1024 MiB, rank1 512 MiB")


def test_the_idle_limit_releases_and_the_next_cell_says_why():
    lock = threading.Lock()
    keeper, k = Keeper(lock), kept(limit=0.1)
    keeper.after_cell(k, {"t": torch.zeros(1)})
    deadline = time.monotonic() + 10
    while keeper.kept is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert keeper.kept is None and k.handle is None

    class Sink:
        lines = []

        def write(self, stream, text):
            self.lines.append(text)

    assert keeper.take(Sink()) is None
    assert "were released after 0 s idle (--keep 0.1s)" in Sink.lines[0]
    assert keeper.take(Sink()) is None and len(Sink.lines) == 1  # said once


def test_the_idle_limit_waits_while_a_cell_runs():
    lock = threading.Lock()
    keeper, k = Keeper(lock), kept(limit=0.05)
    with lock:
        keeper.after_cell(k, {})
        time.sleep(0.3)
        assert keeper.kept is k  # the running cell decides
    assert keeper.release() == "taas: released the kept ranks (2 on cpu/gloo)"
    assert keeper.release() is None
