"""In a rank: a registered loader's name is a :class:`LoaderView` of this rank's units.

Rank r of N takes units u = r, r+N, r+2N, ... < K in order.  Each ``for`` over the view yields
the rank's units of one pass and stops at the pass's end (which the loader workers announce);
the next ``for`` goes on with the next pass, until K units are used up.  A ``for`` left early
(``break``) is resumed by the next one, so no unit is lost.  ``len(view)`` is what the next
``for`` yields.

:func:`install_views` (called by the rank runtime before the cell runs) waits until every
loader worker has its first slice ready, so the cell starts with data at hand.

On a CUDA rank every tensor the view yields is in pinned (page-locked) host memory, as
``DataLoader(pin_memory=True)`` gives them, so ``batch.to(device, non_blocking=True)`` overlaps
the copy with compute.  The reader thread copies each unit out of its shared-memory block into
torch's pinned-memory cache, ahead of the cell (the unit's block goes back to its worker at
once).  Not ``cudaHostRegister`` of the blocks themselves: a block returns to its worker for
reuse when the rank's tensors are garbage, which can be while a non-blocking copy still reads
it; torch's pinned cache records the copy's stream and keeps the buffer until it is done.
(``benchmarks/gpu.py`` measures both.)  CPU ranks get the blocks' tensors as before.

:func:`close_views` (at the rank's exit) tells the workers this rank is gone and sends the
figures the notebook's summary line shows.  A kept rank (``--keep``) gets fresh views for each
cell that reads a registered loader, from that cell's loader workers, and closes them at the
cell's end with ``release=True``: its reader threads end and the channels' fds and mappings
go (the rank lives on); the cell's names for them are spent views that say so when iterated.
A loader worker that fails in a kept cell does not stop the ranks: the kernel marks the failure
(:meth:`taas.data.transport.Transport.fail`) and the view raises :class:`LoaderFailed` with
its line in the cell's code, at the next unit the cell asks for.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import threading
import time
from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Callable

from taas.data import messages
from taas.data.plan import Plan, share
from taas.data.transport import PASS_END, attach

class LoaderFailed(RuntimeError):
    """A loader worker of this cell failed (kept ranks: the kernel's line says which and why;
    its traceback is shown in the notebook)."""


_views: list["LoaderView"] = []
_by_name: dict[str, "LoaderView"] = {}


def view_named(name: str) -> "LoaderView":
    """This rank's view of the registered loader the notebook calls ``name``."""
    return _by_name[name]


def install_views(loaders: dict, namespace: dict) -> None:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    started = time.perf_counter()
    for cfg in loaders.values():
        view = LoaderView(cfg, rank, pinning_for(cfg.get("device"), local_rank))
        _views.append(view)
        for alias in cfg["names"]:
            namespace[alias] = view
            _by_name[alias] = view
    for view in _views:
        view._await_prefetch()
    waited = time.perf_counter() - started
    for view in _views:
        view._started = time.perf_counter()
        messages.send(messages.Started(loader=view.name, rank=rank, prefetch_s=waited))


def close_views(release: bool = False) -> None:
    """This rank is done with its views (whatever happened): stats out, channels closed.
    ``release``: the rank lives on (kept ranks, at a cell's end): free the views' fds and
    mappings too, once their reader threads are out."""
    _by_name.clear()
    while _views:
        view = _views.pop()
        try:
            view._close()
            if release:
                view._release()
        except Exception:  # best effort: the transport's resources die with the job (or the rank)
            pass


# -- pinned batches on CUDA ranks ----------------------------------------------------------
def _pin_tensor(t):
    """``t`` copied into pinned host memory (torch's cache of page-locked buffers: after the
    first units no new ``cudaHostAlloc``); a leaf that required grad still does."""
    p = t.detach().pin_memory()
    return p.requires_grad_(True) if t.requires_grad else p


def _cuda_thread(device: int) -> None:
    """The reader thread's set-up before it pins, as DataLoader's pin thread does: the rank's
    GPU is this thread's current device (CUDA's is per thread; a thread left on device 0 would
    make every rank open a context on GPU 0), and one CPU thread for the copies."""
    import torch

    torch.set_num_threads(1)
    torch.cuda.set_device(device)


@dataclass(frozen=True)
class Pinning:
    """How a CUDA rank's view pins: ``device`` is the rank's GPU; ``tensor`` pins one CPU
    tensor and ``thread`` prepares the reader thread (seams: CPU tests pass fakes)."""

    device: int
    tensor: Callable = _pin_tensor
    thread: Callable = _cuda_thread


def pinning_for(device: str | None, local_rank: int) -> Pinning | None:
    """The decision, as data: a rank whose device is CUDA gets pinned batches on its GPU
    (``cuda:LOCAL_RANK``); a CPU rank (or a job that did not say) gets the blocks' tensors."""
    if device is None or str(device).partition(":")[0] != "cuda":
        return None
    return Pinning(local_rank)


def pinned(value, pin: Callable):
    """``value`` with every CPU tensor in it replaced by ``pin(tensor)``, its structure kept
    (the walk of ``torch.utils.data``'s ``pin_memory``, plus dataclasses: the codec carries
    them).  Anything else (numpy arrays, strings, numbers) is returned as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.layout == torch.strided and not value.is_pinned():
            return pin(value)
        return value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        items = {k: pinned(v, pin) for k, v in value.items()}
        try:
            if isinstance(value, MutableMapping):  # keeps a subclass's own attributes
                clone = copy.copy(value)
                clone.update(items)
                return clone
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(pinned(v, pin) for v in value))
        return type(value)(pinned(v, pin) for v in value)
    if isinstance(value, MutableSequence):
        clone = copy.copy(value)
        for i, v in enumerate(value):
            clone[i] = pinned(v, pin)
        return clone
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        clone = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(clone, f.name, pinned(getattr(value, f.name), pin))  # frozen ones too
        return clone
    return value


class _DatasetInfo:
    """``view.dataset`` in a rank: the dataset's length (the dataset stays in the workers)."""

    def __init__(self, length: int | None, kind: str):
        self._length, self._kind = length, kind

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"the registered loader's {self._kind} has no len()")
        return self._length

    def __repr__(self) -> str:
        return f"<{self._kind} of a registered loader: {self._length} samples, in the loader workers>"


class _Reader:
    """Takes this rank's records ahead of the cell, in the order the cell will want them, so
    that decoding a unit happens while the rank computes, not when it asks for the next one.
    At most ``depth`` units wait here (they count as the rank's, not the channel's)."""

    def __init__(self, view: "LoaderView", depth: int = 4):
        self.view, self.depth = view, depth
        self.items: collections.deque = collections.deque()
        self.units = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.exited = False  # the thread is out of the receivers (see after())
        self._then: Callable[[], None] | None = None
        threading.Thread(target=self._run, name=f"taas-view-{view.name}", daemon=True).start()

    def after(self, then: Callable[[], None]) -> None:
        """Run ``then`` once the thread has left the receivers: now, or as it exits (it does
        within half a second of :meth:`stop`, as the receivers were closed)."""
        with self.cond:
            if not self.exited:
                self._then = then
                return
        then()

    def _run(self) -> None:
        try:
            self._read()
        finally:
            with self.cond:
                self.exited = True
                then, self._then = self._then, None
            if then is not None:
                then()

    def _read(self) -> None:
        view = self.view
        plan = view._plan
        u = view.rank
        pinning = view._pinning
        try:
            if pinning is not None:
                pinning.thread(pinning.device)
            while u < plan.units and not self.stopped:
                rx = view._rx[u % plan.workers]
                header = rx.peek()
                if header.kind == PASS_END:
                    rx.skip()
                    self._put(("end", header.aux, header.unit, 0))
                    continue
                value, nbytes = rx.take()
                if pinning is not None:  # here, ahead of the cell: the copy overlaps its compute
                    value = pinned(value, pinning.tensor)
                self._put(("unit", header.unit, value, nbytes))
                u += plan.ranks
        except BaseException as exc:  # shown where the cell asks for the unit
            if not self.stopped:
                self._put(("error", exc, None, 0))

    def _put(self, item) -> None:
        with self.cond:
            while self.units >= self.depth and not self.stopped:
                self.cond.wait()
            self.items.append(item)
            self.units += item[0] == "unit"
            self.cond.notify_all()

    def first(self, wait: bool = False, check: Callable[[], None] = lambda: None):
        """The next item; ``wait``: until there is one, calling ``check`` (which may raise)
        every tenth of a second meanwhile."""
        with self.cond:
            while wait and not self.items:
                check()
                self.cond.wait(0.1)
            return self.items[0] if self.items else None

    def pop(self) -> None:
        with self.cond:
            item = self.items.popleft()
            self.units -= item[0] == "unit"
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.items.clear()
            self.cond.notify_all()


class LoaderView:
    def __init__(self, cfg: dict, rank: int, pinning: Pinning | None = None):
        self.name = cfg["name"]
        self.rank = rank
        self._pinning = pinning  # CUDA ranks: tensors land in pinned memory (pinning_for)
        self._plan = Plan(cfg["units"], cfg["workers"], cfg["ranks"], cfg["prefetch"])
        self._length = cfg["length"]
        self.batch_size = cfg.get("batch_size")
        self.dataset = _DatasetInfo(cfg.get("dataset_len"), cfg.get("dataset_type", "dataset"))
        self._rx = {}
        self._channel = {}
        try:
            self._endpoint = attach(cfg["address"])
            for worker in self._plan.workers_of(rank):
                channel = self._plan.channel(worker, rank)
                self._channel[worker] = channel
                self._rx[worker] = self._endpoint.receiver(channel)  # pinning is the view's (above)
        except FileNotFoundError:
            # Only a kept cell's loader job can end before its ranks attach (every worker
            # failed, and its clean-up removed the channels): the kernel shows why.
            raise LoaderFailed(f"loader `{self.name}`: its loader workers ended before rank {rank} "
                               "could read from them") from None
        self._next = rank  # the next unit this rank takes
        self._pass = 0  # the pass the next `for` iterates
        self._starts = {0: 0}  # pass -> its first unit
        self._units = self._bytes = 0
        self._wait = 0.0
        self._started = time.perf_counter()
        self._closed = False
        self._spent = False  # closed at a kept cell's end: iterating it is an error
        self._reader = _Reader(self)

    # -- the loader interface --------------------------------------------------------------
    def __iter__(self):
        if self._spent:
            raise RuntimeError(
                f"`{self.name}` is the view of a registered loader from an earlier cell on these kept "
                "ranks, and its units were that cell's: read the loader in this cell's own code so "
                "that this cell gets its units")
        return self._iterate()

    def _check(self) -> None:
        """A worker of this cell's loader failed (kept ranks): raise it here, in the cell."""
        failed = self._endpoint.failure()
        if failed is not None:
            raise LoaderFailed(failed)

    def _iterate(self):
        plan, p = self._plan, self._pass
        while not self._closed:
            u = self._next
            end = self._starts.get(p + 1)
            if u >= plan.units or (end is not None and u >= end):
                self._pass = p + 1
                self._starts.setdefault(p + 1, min(u, plan.units))
                return
            self._check()
            item = self._reader.first()
            if item is None:  # not read yet: this rank waits for data
                channel = self._channel[u % plan.workers]
                waited = time.perf_counter()
                self._endpoint.want(channel, u)
                try:
                    item = self._reader.first(wait=True, check=self._check)
                finally:
                    self._endpoint.want(channel, None)
                self._wait += time.perf_counter() - waited
            kind, a, b, nbytes = item
            if kind == "end":  # pass a ended before unit b
                self._reader.pop()
                self._starts.setdefault(a + 1, b)
                continue
            if kind == "error":
                raise a
            if a != u:  # pragma: no cover - a broken invariant, never user error
                raise RuntimeError(f"taas data plane: expected unit {u} of `{self.name}`, got {a}")
            self._reader.pop()
            self._next += plan.ranks
            self._units += 1
            self._bytes += nbytes
            yield b

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"loader `{self.name}` has no len(): its passes have no known size")
        start = self._starts.get(self._pass, self._next)
        end = self._starts.get(self._pass + 1, start + self._length)
        return share(self._next, min(end, self._plan.units), self.rank, self._plan.ranks)

    def __getattr__(self, attr: str):
        if attr.startswith("__") or "name" not in self.__dict__:
            raise AttributeError(attr)
        raise AttributeError(
            f"`{self.name}` is a view of a registered loader in this rank (the loader itself runs "
            f"in loader workers): it has no attribute {attr!r}; iterate it, or use len() or "
            ".dataset / .batch_size")

    def __repr__(self) -> str:
        left = share(self._next, self._plan.units, self.rank, self._plan.ranks)
        return (f"<taas view of loader `{self.name}`: rank {self.rank} of {self._plan.ranks}, "
                f"{self._units} units taken, {left} to come>")

    # -- life cycle ------------------------------------------------------------------------
    def _await_prefetch(self) -> None:
        endpoint, workers = self._endpoint, range(self._plan.workers)
        while not all(endpoint.prefetched(w) for w in workers):
            self._check()
            time.sleep(0.005)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        elapsed = time.perf_counter() - self._started
        self._reader.stop()
        for rx in self._rx.values():
            rx.close()
        messages.send(messages.Stats(loader=self.name, rank=self.rank, units=self._units,
                                     bytes=self._bytes, wait_s=self._wait, elapsed_s=elapsed))

    def _release(self) -> None:
        """After :meth:`_close`, in a rank that lives on: the receivers' fds and mappings and
        the endpoint go once the reader thread is out of them."""
        self._spent = True
        receivers, endpoint = list(self._rx.values()), self._endpoint
        self._rx = {}

        def release() -> None:
            for rx in receivers:
                rx.release()
            endpoint.close()

        self._reader.after(release)
