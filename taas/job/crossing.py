"""What a value becomes when it crosses between the kernel and a rank.

Most values travel as they are (cloudpickle).  Three kinds must not, and this module is the one
place that knows them, as a registry keyed by the *qualified name* of a class in the value's
MRO (so nothing here imports IPython, torch or a library; subclasses match too):

* **Kernel-only objects**, kernel -> rank.  IPython's ``exit`` / ``quit`` (an
  ``ExitAutocall``) and ``get_ipython`` mean nothing outside the kernel, yet a notebook
  function that mentions them carries them in its globals.  In a rank they arrive as their
  plain-Python meaning: ``exit``/``quit`` are ``sys.exit`` (the rank ends as with
  ``sys.exit``), ``get_ipython()`` returns ``None`` as it does outside IPython.
* **Objects holding their process's distributed state**, both ways.  Hugging Face
  ``TrainingArguments`` caches the process's device and accelerate ``PartialState`` when it is
  built; accelerate's ``PartialState``/``AcceleratorState`` are views of a per-process shared
  state.  Such an object travels without that state and rebuilds it where it lands: in a rank
  it describes the job (world size N, rank r), back in the kernel the kernel's process.
* **Wrappers bound to the job's process group**, rank -> kernel (results).  A
  ``DistributedDataParallel`` anywhere in a result (in a dict, a list, an attribute of a user
  object, inside Lightning Fabric's ``_FabricModule``) comes back as the module it wraps;
  Fabric's optimizer and dataloader wrappers as the optimizer and dataloader they wrap.

:class:`Pickler` applies the registry for one direction (``TO_RANK`` or ``TO_KERNEL``) through
``reducer_override``; :func:`dumps` is cloudpickle with it.  :func:`load_result` unpickles one
result in the kernel so that nothing it raises costs more than that value.  To teach taas another library
type, add its qualified name and a reducer to :data:`_TO_RANK` and/or :data:`_TO_KERNEL`.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
import types
from typing import Callable

import cloudpickle

TO_RANK, TO_KERNEL = "to_rank", "to_kernel"
# Between two taas processes of the kernel's side (the kernel and its job host, taas.host.serve):
# every value as it is, code objects keeping their file names.
AS_IS = "as_is"

log = logging.getLogger(__name__)


# -- what arrives ------------------------------------------------------------------------------
def get_ipython():
    """``get_ipython`` in a rank: there is no IPython shell there, as in a plain script."""
    return None


def kernel_meaning(name: str):
    """The plain-Python meaning, in a rank, of the kernel object IPython calls ``name``."""
    return get_ipython if name == "get_ipython" else sys.exit


def _itself(value):
    return value


def _blank(cls):
    return cls.__new__(cls)


def _training_arguments_state(obj, state: dict) -> None:
    """Restore a ``TrainingArguments`` and set up its devices in *this* process, as its
    ``__post_init__`` does (so ``world_size``, ``process_index``, ``should_save`` describe it)."""
    obj.__dict__.update(state)
    obj.device  # noqa: B018 - the cached_property that builds distributed_state


def _process_state(cls, cpu: bool):
    """accelerate's PartialState/AcceleratorState: this process's own shared state."""
    return cls(cpu=cpu)


# -- reducers ----------------------------------------------------------------------------------
def _exit_autocall(obj):
    return kernel_meaning, ("exit",)


def _bound_method(obj):
    func = getattr(obj, "__func__", None)
    if getattr(func, "__qualname__", "") == "InteractiveShell.get_ipython" and \
            getattr(func, "__module__", "").startswith("IPython."):
        return kernel_meaning, ("get_ipython",)
    return NotImplemented


_PROCESS_BOUND_TA = ("_setup_devices", "distributed_state", "_n_gpu")


def _training_arguments(obj):
    state = {k: v for k, v in vars(obj).items() if k not in _PROCESS_BOUND_TA}
    return _blank, (type(obj),), state, None, None, _training_arguments_state


def _accelerate_state(obj):
    return _process_state, (type(obj), bool(getattr(obj, "_cpu", False)))


def _unwrap(attr: str):
    def reduce(obj):
        return _itself, (getattr(obj, attr),)
    return reduce


_PROCESS_BOUND = {
    "transformers.training_args.TrainingArguments": _training_arguments,
    "accelerate.state.PartialState": _accelerate_state,
    "accelerate.state.AcceleratorState": _accelerate_state,
}

_TO_RANK: dict[str, Callable] = {
    "IPython.core.autocall.ExitAutocall": _exit_autocall,
    "builtins.method": _bound_method,
    **_PROCESS_BOUND,
}

_WRAPPERS = {
    "torch.nn.parallel.distributed.DistributedDataParallel": _unwrap("module"),
    "lightning_fabric.wrappers._FabricModule": _unwrap("_original_module"),
    "lightning_fabric.wrappers._FabricOptimizer": _unwrap("_optimizer"),
    "lightning_fabric.wrappers._FabricDataLoader": _unwrap("_dataloader"),
}
# The `lightning` package ships the same classes under lightning.fabric.
_WRAPPERS.update({name.replace("lightning_fabric.", "lightning.fabric.", 1): reducer
                  for name, reducer in list(_WRAPPERS.items()) if name.startswith("lightning_fabric.")})

_TO_KERNEL: dict[str, Callable] = {**_PROCESS_BOUND, **_WRAPPERS}

_REGISTRY: dict[str, dict] = {TO_RANK: _TO_RANK, TO_KERNEL: _TO_KERNEL, AS_IS: {}}
_by_type: dict[tuple[str, type], Callable | None] = {}


def reducer_for(cls: type, direction: str) -> Callable | None:
    """The registry's reducer for instances of ``cls`` travelling in ``direction``, or None."""
    key = (direction, cls)
    try:
        return _by_type[key]
    except KeyError:
        pass
    registry = _REGISTRY[direction]
    found = None
    for base in getattr(cls, "__mro__", ()):
        found = registry.get(f"{base.__module__}.{base.__qualname__}")
        if found is not None:
            log.debug("%s.%s crosses %s as %s says", cls.__module__, cls.__qualname__, direction,
                      getattr(found, "__qualname__", found))
            break
    _by_type[key] = found
    return found


class Pickler(cloudpickle.Pickler):
    """cloudpickle that applies the registry for one direction, after ``hook`` (obj -> reduce
    tuple or NotImplemented: where tensor storages land, :mod:`taas.job.devices`)."""

    def __init__(self, file, direction: str, hook: Callable | None = None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._direction = direction
        self._hook = hook

    def reducer_override(self, obj):
        if type(obj) is types.CodeType:
            return _code_reduce(obj)
        if self._hook is not None:
            reduced = self._hook(obj)
            if reduced is not NotImplemented:
                return reduced
        reducer = reducer_for(type(obj), self._direction)
        if reducer is not None:
            reduced = reducer(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _code_reduce(code):
    """cloudpickle's reduction of a code object, keeping its ``co_filename``.

    cloudpickle >= 3.1.3 replaces every shipped function's file name by ``"<dynamic-code>"``
    (for byte-identical pickles); taas needs the cell's name there, which is what maps a
    rank's traceback back to the notebook cell and its lines."""
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    if code.co_filename not in args:
        args = tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)
    return constructor, args


def unwrap(value):
    """``value`` without the wrappers around it (DDP, Fabric's): what comes back for it."""
    while True:
        reducer = reducer_for(type(value), TO_KERNEL)
        reduced = reducer(value) if reducer is not None else NotImplemented
        if reduced is NotImplemented or reduced[0] is not _itself:
            return value
        value = reduced[1][0]


def dumps(value, direction: str, hook: Callable | None = None) -> bytes:
    buffer = io.BytesIO()
    Pickler(buffer, direction, hook).dump(value)
    return buffer.getvalue()



# Results are pickled (and unpickled) with the recursion limit raised to this: pickling takes
# two levels of it per level of nesting, so ~15,000 levels (a 5,000-deep nested list needs
# 10,000).  Measured: 20,000 levels of a list fit an 8 MB C stack.
RESULT_RECURSION_LIMIT = 30_000


def load_result(blob: bytes):
    """In the kernel: (value, None), or (None, why) -- whatever unpickling one result raises
    (SystemExit from a __setstate__ included, but Ctrl-C) costs that value only."""
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(max(limit, RESULT_RECURSION_LIMIT))
        return pickle.loads(blob), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # user code in __setstate__ may raise anything: it costs this value only
        return None, f"{type(exc).__name__}: {exc}".rstrip(": ")
    finally:
        sys.setrecursionlimit(limit)
