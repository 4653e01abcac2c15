"""Hugging Face's and Lightning's own logged metrics feed ``taas.log``'s rows, with no code change.

Patched lazily, as :mod:`taas.rank.patches` patches torch, but only when the cell (or a notebook
value it reads) imports the library: a finder on ``sys.meta_path`` waits for the module that
defines the ``Trainer`` class and patches the class once it is loaded (or at once, when it is
already imported).  Importing transformers or Lightning ourselves would cost seconds per rank.

* ``transformers.Trainer``: every Trainer gets a ``TrainerCallback`` whose ``on_log`` records
  the ``logs`` dict at ``state.global_step`` (what Trainer also prints and sends to its
  ``report_to`` integrations).
* Lightning's ``Trainer`` (``lightning.pytorch`` and ``pytorch_lightning``): every Trainer gets a
  ``Callback`` that records ``trainer.callback_metrics`` (what ``self.log`` in the module
  logged) at ``trainer.global_step``: after a training batch when Lightning itself would log
  (``log_every_n_steps``: reading a CUDA metric syncs the device, so no more often than that),
  and after each validation and training epoch.  A value Lightning still holds unchanged from
  before (a validation loss during the next epoch's batches) is not recorded again.  A callback,
  not a logger, so that a Trainer built with ``logger=False`` still draws its metrics, and
  nothing about where Lightning writes changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable

Log = Callable[[int | None, dict], None]

# module that defines the Trainer class -> how to patch that module
TARGETS: dict[str, str] = {
    "transformers.trainer": "hugging_face",
    "lightning.pytorch.trainer.trainer": "lightning",
    "pytorch_lightning.trainer.trainer": "lightning",
}


def install(log: Log) -> None:
    """Patch what is imported already; patch the rest when it is imported."""
    for name, how in TARGETS.items():
        module = sys.modules.get(name)
        if module is not None:
            _patch(module, how, log)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(log))


def _patch(module, how: str, log: Log) -> None:
    trainer = getattr(module, "Trainer", None)
    if trainer is None or getattr(trainer.__init__, "_taas", False):
        return
    add = _hugging_face_callback if how == "hugging_face" else _lightning_callback
    original = trainer.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            add(self, log, module)
        except Exception as exc:  # a library version we do not know: the job goes on unplotted
            print(f"taas: {type(self).__name__}'s metrics are not drawn ({type(exc).__name__}: {exc})",
                  file=sys.stderr)

    __init__._taas = True  # type: ignore[attr-defined]
    trainer.__init__ = __init__


def _hugging_face_callback(trainer, log: Log, module) -> None:
    from transformers import TrainerCallback

    class TaasCallback(TrainerCallback):
        """taas: Trainer's logs feed the cell's metrics plot and ``taas.metrics()``."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                log(state.global_step, {k: v for k, v in logs.items() if v is not None and not isinstance(v, str)})

    trainer.add_callback(TaasCallback())


def _lightning_callback(trainer, log: Log, module) -> None:
    package = module.__name__.split(".trainer.")[0]  # lightning.pytorch or pytorch_lightning
    callback_class = importlib.import_module(package).Callback

    class TaasCallback(callback_class):  # type: ignore[valid-type, misc]
        """taas: what the LightningModule logs feeds the cell's metrics plot and ``taas.metrics()``."""

        def __init__(self) -> None:
            self.last: dict[str, float] = {}

        def _record(self, trainer) -> None:
            fresh = {}
            for name, value in trainer.callback_metrics.items():
                try:
                    number = float(value)
                except (TypeError, ValueError, RuntimeError):  # not one number: not a scalar to draw
                    continue
                if self.last.get(name) != number:
                    fresh[name] = self.last[name] = number
            if fresh:
                log(int(trainer.global_step), fresh)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            every = getattr(trainer, "log_every_n_steps", 1) or 0
            if every and (trainer.global_step % every == 0 or trainer.should_stop):
                self._record(trainer)

        def on_validation_end(self, trainer, pl_module):
            if not getattr(trainer, "sanity_checking", False):
                self._record(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            self._record(trainer)

    trainer.callbacks.append(TaasCallback())


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after it is executed (see the module docstring)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.busy: set[str] = set()  # names being looked up through the other finders

    def find_spec(self, name, path, target=None):
        if name not in TARGETS or name in self.busy:
            return None
        self.busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.busy.discard(name)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, lambda module: _patch(module, TARGETS[name], self.log))
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """Another loader, then the patch; everything else (get_source, is_package...) is the other's."""

    def __init__(self, loader, after: Callable) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
