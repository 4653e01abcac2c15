"""``display()`` and matplotlib figures from rank 0 reach the notebook.

Rank 0 formats an object into a MIME bundle and sends it on the events pipe; the kernel
publishes it in the cell.  Other ranks print the object's repr, tagged like any output.
What formats it is chosen in the kernel by the notebook layer and arrives with the payload as
``"module:factory"`` (:attr:`taas.job.package.Payload.display_formatter`): :mod:`taas.magics`
names IPython's DisplayFormatter, so a rank formats an object exactly as the notebook would
(its ``_repr_*_`` methods, IPython's pretty printer), while the rank runtime itself never
names IPython.  Without one (a script driving :class:`taas.session.Session`) the bundle is
the object's repr.  Figures: ``MPLBACKEND`` points matplotlib at
:mod:`taas.rank.mpl_backend`, whose ``show()`` sends each figure as PNG.
"""

from __future__ import annotations

import importlib
import logging

from taas.launch.process import events

log = logging.getLogger(__name__)

_rank = 0
_formatter: str | None = None  # "module:factory" (see the module docstring), imported on first use


def install(rank: int, formatter: str | None = None) -> None:
    global _rank, _formatter
    _rank, _formatter = rank, formatter
    if rank == 0:
        log.debug("display() formats with %s", formatter or "repr")


def display(*objs, **kwargs) -> None:
    for obj in objs:
        if _rank != 0:
            print(repr(obj))
            continue
        data, metadata = format_bundle(obj)
        events.send("display", data=data, metadata=metadata)


def format_bundle(obj, formatter: str | None = None) -> tuple[dict, dict]:
    """``obj`` as (MIME bundle of strings, metadata), by ``formatter`` (default: the installed
    one); its repr when there is none or formatting fails."""
    spec = formatter or _formatter
    data = None
    if spec is not None:
        module, _, factory = spec.partition(":")
        try:
            data, metadata = getattr(importlib.import_module(module), factory)().format(obj)
        except Exception:  # a user _repr_*_ may raise anything (or the formatter is missing): repr
            data = None
    if data is None:
        data, metadata = {"text/plain": repr(obj)}, {}
    return {k: v for k, v in data.items() if isinstance(v, str)}, metadata
