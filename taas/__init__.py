"""taas: run a notebook cell as an N-rank torch.distributed job.

In a notebook::

    %load_ext taas

    #pragma taas --gpus 2        (or:  %%taas --gpus 2)
    <ordinary PyTorch>

``import taas`` works in any Python process; IPython is only touched by
``load_ipython_extension``.
"""

from __future__ import annotations

__version__ = "0.1.0"

_loaded: dict = {}

# The data plane's public API (taas.register(loader), ...), imported on first use so that
# `import taas` stays cheap (no torch).
_DATA_API = ("register", "unregister", "is_registered", "registered", "get_worker_info", "WorkerInfo")
__all__ = ["load_ipython_extension", "unload_ipython_extension", *_DATA_API]


def __getattr__(name: str):
    if name in _DATA_API:
        from taas.data import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'taas' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_DATA_API))


def load_ipython_extension(ipython) -> None:
    """``%load_ext taas``: the magics, the ``#pragma taas`` transformer, a warm start process."""
    from taas.magics import TaasMagics, pragma_transformer
    from taas.session import Session

    if _loaded.get("shell") is ipython:
        return
    session = Session()
    session.warm()  # torch imports in the background while the user writes the next cell
    ipython.register_magics(TaasMagics(ipython, session))
    ipython.input_transformers_cleanup.insert(0, pragma_transformer)
    _loaded.update(shell=ipython, session=session)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext taas``: remove everything ``load_ipython_extension`` added."""
    from taas.magics import pragma_transformer

    if _loaded.get("shell") is not ipython:
        return
    if pragma_transformer in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(pragma_transformer)
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("taas", None)
    _loaded.pop("session").close()
    _loaded.clear()
