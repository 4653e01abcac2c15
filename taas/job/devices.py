"""Where tensors land when they cross: a device map applied to tensor *storages* while pickling.

torch pickles a CUDA tensor with its device (``torch.save`` bytes saying ``cuda:0``), so a
notebook's ``Net().cuda()`` shipped to 8 ranks would be rebuilt 8 times on ``cuda:0``.  Every
tensor, ``nn.Parameter``, module parameter or buffer, sparse or nested tensor reduces to its
storages, so that is the one place to decide, whatever holds the tensors:

    kernel  a CUDA storage ──its bytes to host memory, once per storage──> (_arrive, (recorded device, host bytes))
            (big storages: into ONE shared-memory file every rank maps, by BigValues.copy_in)
    rank    _arrive: the host storage moved to target_device(recorded, LOCAL_RANK, rank's device),
            once per storage

torch makes a TypedStorage per tensor and pickles each on its own (views of one storage would
arrive as copies); here one Python object stands for each storage, so pickle's memo reduces it
once and hands the one rebuilt storage to every tensor over it: views stay views of one storage
and a module's tied weights stay tied.  CPU storages cross the same way, as their bytes (big
ones through :mod:`taas.job.memory.bigvalues`), and stay where they are; meta ones as torch
pickles them.  The rule (:func:`target_device`) is pure: a CUDA value lands on the rank's own
GPU, ``cuda:LOCAL_RANK``, whichever GPU it had in the notebook; on CPU ranks, on the CPU.

Results (rank 0 -> kernel) cross the same way, landing on the CPU (the default: a result's
tensors, modules and optimizer state arrive on the CPU wherever they sit in it, and the kernel
never holds a GPU's memory after the job) or, with ``--results-device keep``, on the device
they had on rank 0; rank 0's own objects are not touched either way.

Seams for tests without a GPU: the kernel side's ``recorded(storage)`` (which storages count as
on a device, and which) and the rank side's placement (:func:`placing`).  No torch import at
module level: the kernel only looks at types of modules the notebook already imported.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from typing import Callable

# -- the rule ----------------------------------------------------------------------------------


def target_device(recorded: str, local_rank: int, rank_device: str) -> str:
    """Where a storage recorded on ``recorded`` in the notebook lands in a rank whose device
    type is ``rank_device`` (``cuda``/``cpu``; an index there is ignored: a rank's GPU is
    ``cuda:LOCAL_RANK``).  Only CUDA values move; CPU and meta ones stay where they are."""
    if recorded.partition(":")[0] != "cuda":
        return recorded
    if rank_device.partition(":")[0] == "cuda":
        return f"cuda:{local_rank}"
    return "cpu"  # CPU ranks never touch a GPU the job does not own


def cuda_recorded(storage) -> str | None:
    """The device a storage is recorded on when it must be mapped (CUDA ones), else None."""
    device = storage.device
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else 0
    return f"cuda:{index}"


# -- the rank side -----------------------------------------------------------------------------
_place: Callable[[str], str] | None = None  # set by placing() while the payload is unpickled


def placement(rank_device: str, local_rank: int) -> Callable[[str], str]:
    """A rank's placement: recorded device -> the device it lands on (:func:`target_device`)."""
    return lambda recorded: target_device(recorded, local_rank, rank_device)


@contextlib.contextmanager
def placing(place: Callable[[str], str] | None):
    """Unpickle under ``place`` (None: the rule for this process: ``LOCAL_RANK``, CUDA if it
    has any)."""
    global _place
    before, _place = _place, place
    try:
        yield
    finally:
        _place = before


def _default_place(recorded: str) -> str:
    import torch

    rank_device = "cuda" if torch.cuda.is_available() else "cpu"
    return target_device(recorded, int(os.environ.get("LOCAL_RANK", "0") or 0), rank_device)


def _arrive(recorded: str, host):
    """The unpickler's call, once per storage: the host storage on its target device."""
    return _move(host, (_place or _default_place)(recorded))


def _kept(recorded: str, host):
    """Results with ``--results-device keep``: back on the device they had on rank 0."""
    return _move(host, recorded)


def _move(host, target: str):
    if target == "cpu":
        return host
    import torch

    flat = torch.empty(0, dtype=torch.uint8).set_(host)  # (storages have no .to(meta))
    return flat.to(target).untyped_storage()


def _from_bytes(data):
    """A CPU storage holding ``data`` (a storage's bytes pickled inline: a bytearray), torch's
    own memory as after torch.load (resizable)."""
    import torch

    storage = torch.UntypedStorage(len(data))
    if data:
        torch.empty(0, dtype=torch.uint8).set_(storage).copy_(torch.frombuffer(data, dtype=torch.uint8))
    return storage


def _typed(untyped, dtype):
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _itself(value):
    return value


# -- the kernel side ---------------------------------------------------------------------------
def storage_types() -> dict[type, str]:
    """The storage types worth a look (none if the notebook never imported torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "UntypedStorage"):
        return {}
    return {torch.storage.TypedStorage: "typed", torch.UntypedStorage: "untyped"}


def host_bytes(storage) -> pickle.PickleBuffer:
    """A storage's bytes, copied to host memory once, to pickle inline: a PickleBuffer is
    written straight into the pickle (protocol 5) and read back as a bytearray."""
    import torch

    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    host = flat.cpu()  # (a CPU storage: itself, its bytes copied into the pickle)
    return pickle.PickleBuffer(host.numpy())  # type: ignore[arg-type]  # (numpy arrays are buffers)


class DeviceStorages:
    """One pickling's storages, kernel side: ``reduce(obj)`` is a reduce tuple for a CPU
    storage or one ``recorded`` says is on a device (CUDA), else NotImplemented.

    A recorded storage's ``land`` says where it lands: ``rank`` (to the ranks: :func:`_arrive` places it), ``cpu``
    (results back: on the CPU) or ``keep`` (results back: on the device it had).  It crosses as
    its bytes copied to host; with ``copy_in`` (storage -> reduce tuple or None:
    :meth:`taas.job.memory.bigvalues.BigValues.copy_in`) a big one's bytes go once into shared
    memory instead of into the pickle.  Other storages (CPU ones) cross as their bytes, after
    ``big`` (obj -> reduce tuple or NotImplemented: :meth:`BigValues.reduce`) had its pick."""

    def __init__(self, *, land: str = "rank", copy_in: Callable | None = None, big: Callable | None = None,
                 recorded: Callable[[object], str | None] = cuda_recorded):
        self._land, self._copy_in, self._big, self._recorded = land, copy_in, big, recorded
        self._types = storage_types()
        self._canonical: dict[int, object] = {}  # StorageImpl address -> the one object pickled for it

    def reduce(self, obj):
        kind = self._types.get(type(obj))
        if kind is None:
            return NotImplemented
        untyped = obj._untyped_storage if kind == "typed" else obj
        recorded = self._recorded(untyped)
        if recorded is None and untyped.device.type != "cpu":
            return NotImplemented  # meta, another accelerator: as torch pickles it
        if recorded is None and self._big is not None:
            reduced = self._big(obj)  # a big CPU storage: into shared memory (bigvalues)
            if reduced is not NotImplemented:
                return reduced
        # Several Python objects stand for one storage (torch makes a TypedStorage per tensor,
        # and pickles each on its own: views would arrive as copies): pickle the first one
        # seen, always, so pickle's memo gives every tensor over it the one rebuilt storage.
        # That holds for CPU storages too; only the ones ``recorded`` names move.
        canonical = self._canonical.setdefault(untyped._cdata, untyped)
        if kind == "typed":
            return _typed, (canonical, obj.dtype)
        if canonical is not obj:
            return _itself, (canonical,)
        if recorded is None:  # a small CPU storage: its bytes
            return _from_bytes, (host_bytes(obj),)
        shared = self._copy_in(obj) if self._copy_in is not None else None
        host = _Shared(shared) if shared is not None else _Inline(host_bytes(obj))
        if self._land == "cpu":
            return _itself, (host,)
        return (_kept if self._land == "keep" else _arrive), (recorded, host)


class _Shared:
    """A reduce tuple to pickle as the object it rebuilds (a storage mapped from shared memory)."""

    def __init__(self, reduced: tuple):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


class _Inline:
    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return _from_bytes, (self.data,)
