"""A loader as numbered units: what loader worker w of M produces.

:func:`units` yields ``(UNIT, u, value)`` for the worker's units (u = w, w+M, ... < K) and
``(END, p, e)`` when pass p ended (e: the first unit of the next pass), pass after pass.

Determinism: every worker seeds torch, random and numpy the same way at the same points, so
whatever M, unit u is the same.  For a map-style DataLoader each worker walks the pass's
batches of indices (cheap) and fetches and collates only its own: the global generators are
seeded with ``mix(seed, 1, p, i)`` before the sampler draws batch i of pass p (a shuffling
sampler, lazy or not, draws the same in every worker) and with ``mix(seed, 2, p, u)`` before
unit u is fetched (random augmentations depend on u, not on M).  Any other iterable is
iterated in full by every worker from ``mix(seed, p)``, keeping every M-th element
(iterate-and-skip): correct for anything, M times the loading work.
"""

from __future__ import annotations

import random
import sys

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
            iterator = indices()
            while u < total:
                seed_all(mix(seed, 1, p, u - start))
                try:
                    index = next(iterator)
                except StopIteration:
                    break
                if u % workers == worker and not (skip and skip(u)):
                    if on_fetch:
                        on_fetch(u)
                    seed_all(mix(seed, 2, p, u))
                    value = fetch(index, alloc_for(u) if alloc_for else None)
                    yield UNIT, u, value
                u += 1
        else:
            iterator = iter(loader)
            try:
                while u < total:
                    if on_fetch:  # every element: a worker that hangs on one it skips is named too
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
