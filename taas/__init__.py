"""taas: run a notebook cell as an N-rank torch.distributed job.

In a notebook::

    %load_ext taas

    #pragma taas --gpus 2        (or:  %%taas --gpus 2)
    <ordinary PyTorch>

``import taas`` works in any Python process and imports neither torch nor IPython; IPython is
only touched here (the extension hook, and finding a running shell's names without importing
it), in :mod:`taas.magics` and in :mod:`taas.notebook`.  The layers below receive what they need from the notebook as
plain values and callables (see ``tests/project/test_layers.py`` for the order of the layers).

``logging.getLogger("taas")`` carries a debug trail of what a job did; it has a NullHandler,
so nothing is printed unless the user adds a handler and lowers its level.
"""

from __future__ import annotations

import logging
import sys

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

_loaded: dict = {}

# The data plane's public API (taas.register(loader), ...), imported on first use so that
# `import taas` stays cheap (no torch).
_DATA_API = ("register", "unregister", "is_registered", "registered", "get_worker_info", "WorkerInfo")
__all__ = ["load_ipython_extension", "unload_ipython_extension", "log", "metrics",  # noqa: PLE0604
           *_DATA_API]

_metrics = None  # taas.job.metrics once taas.log / taas.metrics were used (through the session)


def _metrics_module():
    global _metrics
    if _metrics is None:
        # The public API reaches the rooms below through the composition root (tests/project/
        # test_layers.py); in a rank the rank runtime already pointed it at its buffer.
        from taas.session import job_metrics

        _metrics = job_metrics
    return _metrics


def log(step: int | None = None, **scalars) -> None:
    """Record scalars at ``step``: ``taas.log(step=i, loss=loss.item(), lr=lr)``.

    In a taas rank, rows go to the kernel (rank 0's are drawn live in the cell) at a cost of
    microseconds a call; in the notebook itself they go to the notebook's own history.  Values
    are numbers (numpy scalars and one-element tensors too); anything else, NaN included, is
    left out with one note per name.  ``step`` defaults to one past the last step logged."""
    (_metrics or _metrics_module()).record(step, scalars)


def metrics(job: str = "last"):
    """The rows ``taas.log`` (and Hugging Face's or Lightning's Trainer) recorded, as a pandas
    DataFrame when pandas is installed, else a list of dicts: ``step``, ``rank``, the scalars.

    ``job``: ``"last"`` (the last job that logged anything; the notebook's rows while none
    did), ``"all"`` (every job of this
    kernel and the notebook's own rows, with a ``job`` column; the notebook's rows have
    ``rank`` None), ``"notebook"``, or a job's id."""
    module = _metrics_module()
    return module.frame(module.HISTORY.rows(job))


def __getattr__(name: str):
    if name in _DATA_API:
        from taas.data import registry

        if registry._namespace_source is None:
            registry.set_namespace_source(_notebook_namespace)
        return getattr(registry, name)
    raise AttributeError(f"module 'taas' has no attribute {name!r}")


def _notebook_namespace() -> dict | None:
    """The running IPython shell's user namespace, or None (no shell, or IPython not imported:
    looked up in sys.modules, never imported).  How the registry knows loaders' names."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "user_ns", None)


def __dir__():
    return sorted(set(globals()) | set(_DATA_API))


def load_ipython_extension(ipython) -> None:
    """``%load_ext taas``: the magics, the ``#pragma taas`` transformer, a warm start process."""
    from taas.data import registry
    from taas.magics import TaasMagics
    from taas.notebook import choose_display_formatter, pragma_transformer
    from taas.session import Session

    if _loaded.get("shell") is ipython:
        return
    registry.set_namespace_source(_notebook_namespace)
    choose_display_formatter()
    session = Session()
    magics = TaasMagics(ipython, session)  # (it gives the session the kernel's job host)
    session.warm()  # torch imports in the background while the user writes the next cell
    magics.warm()  # a job host for the first --detach, warm too (TAAS_WARM_HOST=0: none ahead)
    ipython.register_magics(magics)
    ipython.input_transformers_cleanup.insert(0, pragma_transformer)
    ipython.events.register("post_run_cell", session.after_cell)
    _loaded.update(shell=ipython, session=session, magics=magics)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext taas``: remove everything ``load_ipython_extension`` added."""
    from taas.notebook import forget_display_formatter, pragma_transformer

    if _loaded.get("shell") is not ipython:
        return
    if pragma_transformer in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(pragma_transformer)
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("taas", None)
    _loaded.pop("magics").close()
    session = _loaded.pop("session")
    try:
        ipython.events.unregister("post_run_cell", session.after_cell)
    except ValueError:  # someone removed the hook already: nothing left to undo
        pass
    session.close()
    _loaded.clear()
    forget_display_formatter()
