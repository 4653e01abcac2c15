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
    """Seed the CPU generators a loader may use (torch.manual_seed would also queue lazy CUDA,
    XPU and MTIA seeding, formatting a stack trace each time: 0.1 ms a call)."""
    import torch

    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


@contextmanager
def unit_seed(seed: int):
    """Run with every RNG seeded by ``seed``; leave their states as they were."""
    import torch

    numpy = sys.modules.get("numpy")
    generator = torch.default_generator
    saved = (generator.get_state(), random.getstate(), numpy.random.get_state() if numpy else None)
    seed_all(seed)
    try:
        yield
    finally:
        generator.set_state(saved[0])
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


def units(loader, worker: int, workers: int, total: int, seed: int, skip=None, on_fetch=None,
          alloc_for=None):
    """This worker's units of ``loader``, with pass ends.  ``skip(u)``: nobody wants u (do not
    fetch it); ``on_fetch(u)``: called before fetching u (for status); ``alloc_for(u)``: an
    allocator ``(nbytes, dtype, shape) -> tensor or None`` that the default collate function
    may stack unit u's tensors into (the transport's memory), or None."""
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
                        value = fetch(index, alloc_for(u) if alloc_for else None)
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
    """(a function starting a pass of index batches, fetch(index, alloc) -> collated unit)."""
    from torch.utils.data import default_collate

    dataset, collate = loader.dataset, loader.collate_fn
    if loader.batch_sampler is not None:  # automatic batching: lists of indices
        sampler = loader.batch_sampler
        getitems = getattr(dataset, "__getitems__", None)
        in_place = collate is default_collate

        def fetch(index, alloc=None):
            samples = getitems(index) if getitems else [dataset[i] for i in index]
            if alloc is not None and in_place:
                return collate_into(samples, alloc)
            return collate(samples)
    else:
        sampler = loader.sampler

        def fetch(index, alloc=None):
            return collate(dataset[index])

    return (lambda: iter(sampler)), fetch


def collate_into(samples: list, alloc):
    """``default_collate(samples)``, with every stacked tensor written into memory from
    ``alloc(nbytes, dtype, shape)`` when it has room (the same values, one copy fewer)."""
    import torch
    from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

    def tensors(batch, *, collate_fn_map=None):
        elem = batch[0]
        if (type(elem) is torch.Tensor and elem.layout == torch.strided and elem.device.type == "cpu"
                and not elem.is_nested and all(type(b) is torch.Tensor and b.dtype == elem.dtype for b in batch)):
            out = alloc(len(batch) * elem.numel() * elem.element_size(), elem.dtype, (len(batch), *elem.shape))
            if out is not None:
                return torch.stack(batch, 0, out=out)
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)

    return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: tensors})
