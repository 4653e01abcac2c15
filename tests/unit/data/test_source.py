"""Loaders as numbered units, in one process: every worker count gives the same units."""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from taas.data import source


class Indices(Dataset):
    def __init__(self, n=23):
        self.n = n
        self.fetched = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.fetched.append(i)
        return torch.tensor(i), torch.rand(())  # a random "augmentation"


class Stream(IterableDataset):
    def __init__(self, n=10):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class LazyRandomSampler(Sampler):
    """Draws each index from the global RNG only when asked, like some custom samplers."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield int(torch.randint(self.n, ()))


def run(loader, workers, total, seed=1234, skip=None):
    units, ends = {}, set()
    for w in range(workers):
        for kind, a, b in source.units(loader, w, workers, total, seed, skip):
            if kind == source.UNIT:
                assert a % workers == w and a not in units
                units[a] = b
            else:
                ends.add((a, b))
    return units, ends


def as_lists(units):
    return {u: [t.tolist() for t in v] if isinstance(v, (list, tuple)) else v.tolist() for u, v in units.items()}


@pytest.mark.parametrize("make", [
    lambda: DataLoader(Indices(), batch_size=4, shuffle=True),
    lambda: DataLoader(Indices(), batch_size=4, shuffle=True, drop_last=True),
    lambda: DataLoader(Indices(), batch_size=None, shuffle=True),
    lambda: DataLoader(Indices(), batch_sampler=torch.utils.data.BatchSampler(LazyRandomSampler(23), 5, False)),
    lambda: DataLoader(Stream(), batch_size=3),
    lambda: [torch.tensor([i, i]) for i in range(7)],
], ids=["shuffle", "drop_last", "no-batching", "lazy-sampler", "iterable", "list"])
def test_the_same_units_whatever_the_number_of_workers(make):
    total = 50
    one, ends = run(make(), 1, total)
    assert sorted(one) == list(range(total))
    for workers in (2, 3):
        many, ends_many = run(make(), workers, total)
        assert as_lists(many) == as_lists(one)
        assert ends_many == ends
    again, _ = run(make(), 2, total)
    assert as_lists(again) == as_lists(one)  # and run after run
    other, _ = run(make(), 2, total, seed=99)
    if not isinstance(make(), list) and not isinstance(make().dataset, Stream):
        assert as_lists(other) != as_lists(one)  # the seed matters for shuffling


def test_passes_cover_the_dataset_once_each_and_reshuffle():
    loader = DataLoader(Indices(23), batch_size=4, shuffle=True)  # 6 batches a pass
    units, ends = run(loader, 3, 15)
    assert ends == {(0, 6), (1, 12)}  # pass 2 is cut by K: no end
    passes = [sorted(sum((units[u][0].tolist() for u in range(s, e)), [])) for s, e in ((0, 6), (6, 12))]
    assert passes == [list(range(23))] * 2
    order = [[units[u][0].tolist() for u in range(s, e)] for s, e in ((0, 6), (6, 12))]
    assert order[0] != order[1]


def test_map_style_workers_fetch_only_their_own_batches():
    dataset = Indices(40)
    loader = DataLoader(dataset, batch_size=4)
    units = list(source.units(loader, 1, 2, 10, seed=0))
    assert [u for kind, u, _ in units if kind == source.UNIT] == [1, 3, 5, 7, 9]
    assert sorted(dataset.fetched) == [i for b in (1, 3, 5, 7, 9) for i in range(4 * b, 4 * b + 4)]


def test_skipped_units_are_not_fetched():
    dataset = Indices(40)
    loader = DataLoader(dataset, batch_size=4)
    units = list(source.units(loader, 0, 1, 10, seed=0, skip=lambda u: u % 2 == 1))
    assert [u for kind, u, _ in units if kind == source.UNIT] == [0, 2, 4, 6, 8]
    assert len(dataset.fetched) == 20


def test_random_augmentations_depend_on_the_unit_not_on_the_worker_count():
    loader = DataLoader(Indices(23), batch_size=4, shuffle=True)
    one, _ = run(loader, 1, 12)
    three, _ = run(loader, 3, 12)
    assert all(torch.equal(one[u][1], three[u][1]) for u in range(12))
    assert len({tuple(one[u][1].tolist()) for u in range(12)}) == 12  # and differ between units


def test_an_empty_pass_is_an_error_not_a_hang():
    with pytest.raises(source.EmptyPass, match="nothing in pass 0"):
        list(source.units([], 0, 1, 5, seed=0))
    with pytest.raises(source.EmptyPass, match="nothing in pass 0"):
        list(source.units(DataLoader(Stream(0), batch_size=2), 0, 1, 5, seed=0))
