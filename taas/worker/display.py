"""``display()`` and matplotlib figures from rank 0 reach the notebook.

Rank 0 formats an object the way IPython would (its ``_repr_*_`` methods, through IPython's
DisplayFormatter when IPython is installed) and sends the MIME bundle on the events pipe; the
kernel publishes it in the cell.  Other ranks print the object's repr, tagged like any output.
Figures: ``MPLBACKEND`` points matplotlib at :mod:`taas.worker.mpl_backend`, whose ``show()``
sends each figure as PNG.
"""

from __future__ import annotations

from taas.worker import events

_rank = 0


def install(rank: int) -> None:
    global _rank
    _rank = rank


def display(*objs, **kwargs) -> None:
    for obj in objs:
        if _rank != 0:
            print(repr(obj))
            continue
        data, metadata = format_bundle(obj)
        events.send("display", data=data, metadata=metadata)


def format_bundle(obj) -> tuple[dict, dict]:
    try:
        from IPython.core.formatters import DisplayFormatter

        data, metadata = DisplayFormatter().format(obj)
    except Exception:  # a user _repr_*_ may raise anything: fall back to repr
        data, metadata = {"text/plain": repr(obj)}, {}
    return {k: v for k, v in data.items() if isinstance(v, str)}, metadata
