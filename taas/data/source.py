"""A loader as numbered units: what loader worker w of M produces.

:func:`units` yields ``(UNIT, u, value)`` for the worker's units (u = w, w+M, ... < K) and
``(END, p, e)`` when pass p ended (e: the first unit of the next pass), pass after pass.

Determinism: before pass p every worker seeds torch, random and numpy with ``mix(seed, p)``
and starts a new pass of the loader, so a shuffling sampler draws the same permutation in every
worker.  For a map-style DataLoader each worker walks the pass's batches of indices (cheap) and
fetches and collates only its own, inside ``mix(seed, p, u)``-seeded random state (so random
augmentations depend on u, not on M) that is restored afterwards (so a sampler that draws
lazily is not disturbed).  Any other iterable is iterated in full by every worker, which keeps
every M-th element (iterate-and-skip): correct for anything, M times the loading work.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager

from taas.data.plan import mix

UNIT, END = "unit", "end"


class EmptyPass(RuntimeError):
    pass


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


@contextmanager
def unit_seed(seed: int):
    """Run with every RNG seeded by ``seed``; leave their states as they were."""
    import torch

    numpy = sys.modules.get("numpy")
    saved = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None)
    seed_all(seed)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if numpy is not None and saved[2] is not None:
            numpy.random.set_state(saved[2])


def is_map_style(loader) -> bool:
    """A plain DataLoader over a map-style dataset: workers can fetch only their own batches."""
    try:
        from torch.utils.data import DataLoader, IterableDataset
    except ImportError:  # pragma: no cover
        return False
    return (isinstance(loader, DataLoader) and type(loader).__iter__ is DataLoader.__iter__
            and not isinstance(loader.dataset, IterableDataset))


def units(loader, worker: int, workers: int, total: int, seed: int, skip=None, on_fetch=None):
    """This worker's units of ``loader``, with pass ends.  ``skip(u)``: nobody wants u (do not
    fetch it); ``on_fetch(u)``: called before fetching u (for status)."""
    batches = _map_batches(loader) if is_map_style(loader) else None
    u, p = 0, 0
    while u < total:
        seed_all(mix(seed, p))
        start = u
        if batches is not None:
            indices, fetch = batches
            for index in indices():
                if u >= total:
                    break
                if u % workers == worker and not (skip and skip(u)):
                    if on_fetch:
                        on_fetch(u)
                    with unit_seed(mix(seed, p, u)):
                        value = fetch(index)
                    yield UNIT, u, value
                u += 1
        else:
            iterator = iter(loader)
            try:
                while u < total:
                    if u % workers == worker and on_fetch and not (skip and skip(u)):
                        on_fetch(u)
                    try:
                        value = next(iterator)
                    except StopIteration:
                        break
                    if u % workers == worker and not (skip and skip(u)):
                        yield UNIT, u, value
                    u += 1
            finally:
                del iterator  # a DataLoader iterator shuts its own workers down
        if u == start:
            raise EmptyPass(f"the loader yielded nothing in pass {p} (after {start} units), "
                            f"so it cannot produce the {total} units asked for")
        if u < total:
            yield END, p, u
        p += 1


def _map_batches(loader):
    """(a function starting a pass of index batches, fetch(index) -> collated unit)."""
    dataset, collate = loader.dataset, loader.collate_fn
    if loader.batch_sampler is not None:  # automatic batching: lists of indices
        sampler = loader.batch_sampler
        getitems = getattr(dataset, "__getitems__", None)

        def fetch(index):
            return collate(getitems(index) if getitems else [dataset[i] for i in index])
    else:
        sampler = loader.sampler

        def fetch(index):
            return collate(dataset[index])

    return (lambda: iter(sampler)), fetch
