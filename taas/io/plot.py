"""Rank 0's ``taas.log`` scalars drawn in the cell: a PNG redrawn at most once a second.

* :func:`decimate` keeps at most ``MAX_POINTS`` points of a series for drawing (the first and
  last, and each bucket's lowest and highest value, so a spike stays visible); the history
  keeps every row.
* :func:`render` draws one small plot per scalar against step with matplotlib's Agg canvas
  directly (a ``Figure``, never ``pyplot``: nothing of the user's pyplot state, backend or
  open figures is touched).
* :class:`LivePlot` decides when: on new rows, at most every ``interval`` seconds (longer when
  drawing is slow: never more than a fifth of the time), drawn in a thread, shown as one
  display updated in place
  (``sink.live``); where the sink cannot update displays in place it draws once, at the end;
  a sink that shows no images gets one text line instead.

The series come from a callable (name -> (steps, values), NaN where a row lacked the name):
this room imports no other room's modules.  numpy and matplotlib are imported on first draw.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_POINTS = 2000  # points drawn per series
MAX_PANELS = 9  # scalars drawn; the others are named
INTERVAL = 1.0  # seconds between two draws, at least

Series = dict  # name -> (steps, values): sequences of equal length


def decimate(steps, values, max_points: int = MAX_POINTS):
    """(steps, values) as numpy arrays without NaN, at most ``max_points`` of them, in order."""
    import numpy as np

    x = np.array(steps, dtype=np.float64)
    y = np.array(values, dtype=np.float64)
    n = min(len(x), len(y))
    x, y = x[:n], y[:n]
    finite = np.isfinite(y)
    x, y = x[finite], y[finite]
    n = len(y)
    if n <= max_points:
        return x, y
    buckets = max(1, (max_points - 2) // 2)  # two points a bucket, and the first and last
    size = -(-n // buckets)  # ceil
    padded = np.full(buckets * size, np.nan)
    padded[:n] = y
    rows = padded.reshape(buckets, size)
    used = ~np.all(np.isnan(rows), axis=1)
    base = np.arange(buckets)[used] * size
    rows = rows[used]
    keep = np.unique(np.concatenate([[0, n - 1], base + np.nanargmin(rows, axis=1),
                                     base + np.nanargmax(rows, axis=1)]))
    return x[keep], y[keep]


def summary(series: Series) -> str:
    """One line: each scalar's last value and step."""
    parts = []
    for name, (steps, values) in series.items():
        last = next(((s, v) for s, v in zip(reversed(steps), reversed(values)) if not math.isnan(v)), None)
        if last is not None:
            parts.append(f"{name} {last[1]:.4g} (step {last[0]})")
    return ", ".join(parts)


def figure(series: Series, title: str = ""):
    """The series drawn: one plot per scalar (up to ``MAX_PANELS``), each against step, on a
    matplotlib ``Figure`` with an Agg canvas (:func:`render` makes it a PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = [n for n in series if len(series[n][0])][:MAX_PANELS]
    more = len(series) - len(names)
    cols = min(3, max(1, len(names)))
    rows = max(1, -(-len(names) // cols))
    width, height = 3.6 * cols, 2.4 * rows + 0.4
    # Fixed margins (a constrained or tight layout costs more than the drawing itself), in
    # inches: room for the y tick labels whatever the number of columns, and for the titles.
    figure = Figure(figsize=(width, height), dpi=80)
    figure.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.45 / height,
                           top=1 - 0.7 / height, wspace=0.3, hspace=0.55)
    FigureCanvasAgg(figure)
    for i, name in enumerate(names):
        axes = figure.add_subplot(rows, cols, i + 1)
        x, y = decimate(*series[name])
        axes.plot(x, y, linewidth=1.2)
        # Padded: above the exponent matplotlib may put at the axis's top left.
        axes.set_title(f"{name}  {y[-1]:.4g}" if len(y) else name, fontsize=10, pad=12)
        axes.tick_params(labelsize=8)
        # Steps are whole numbers; small or large values (a learning rate) get an exponent
        # above the axis, so that their tick labels stay short enough for the margin.
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5))
        axes.grid(alpha=0.3)
        if i >= len(names) - cols:
            axes.set_xlabel("step", fontsize=9)
    heading = title + (f"  (+{more} more: taas.metrics())" if more > 0 else "")
    if heading:
        figure.suptitle(heading, fontsize=10)
    return figure


def render(series: Series, title: str = "") -> bytes:
    """The series as a PNG (see :func:`figure`)."""
    buffer = io.BytesIO()
    figure(series, title).canvas.print_png(buffer)
    return buffer.getvalue()


class LivePlot:
    """The live plot of one job (see the module docstring).

    A PNG is drawn in a thread of its own (hundreds of milliseconds for a few scalars on a
    busy machine: the supervisor's loop goes on pumping output meanwhile) and shown by the
    caller's thread at its next :meth:`changed` (the sink belongs to that thread)."""

    def __init__(self, sink, series: Callable[[], Series], title: str = "taas metrics (rank 0)",
                 interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self.sink, self.series, self.title = sink, series, title
        self.interval, self.clock = interval, clock
        self.live = hasattr(sink, "live") and getattr(sink, "updates_in_place", True)
        self.next_at = 0.0  # no draw starts before this time
        self.dirty = False  # rows came since the last draw started
        self.drawn = False
        self._drawing: threading.Thread | None = None
        self._done: tuple[dict, float] | None = None  # (bundle, seconds it took), to show

    def changed(self, *_) -> None:
        """New rows arrived: show a finished drawing; start the next if the last was long enough ago."""
        self.dirty = True
        if not self.live:
            return
        self._show_done()
        if self._drawing is None and self.clock() >= self.next_at:
            series = self.series()
            if series:
                self.dirty = False
                self._drawing = threading.Thread(target=self._draw_in_thread, args=(series,),
                                                 name="taas-metrics-plot", daemon=True)
                self._drawing.start()

    def close(self) -> None:
        """The job ended: the last state of the plot (or its summary line), if anything was logged."""
        if self._drawing is not None:
            self._drawing.join()
            self._drawing = None
        if not (self.dirty or self.drawn or self._done):
            return
        series = self.series()
        if not series:
            return
        if not (hasattr(self.sink, "live") or hasattr(self.sink, "display")):
            self.sink.write("stderr", f"taas: metrics of rank 0: {summary(series)}; "
                                      "taas.metrics() has every row\n")
            return
        try:
            self._show(self._bundle(series), final=True)
        except Exception as exc:  # no matplotlib, a front end refusing: the job and its rows go on
            log.warning("the metrics plot is not drawn: %s: %s", type(exc).__name__, exc)

    def _draw_in_thread(self, series: Series) -> None:
        started = time.monotonic()
        try:
            bundle = self._bundle(series)
        except Exception as exc:  # as in close(): the rows are kept, only the picture is lost
            log.warning("the metrics plot is not drawn: %s: %s", type(exc).__name__, exc)
            self.live = False
            return
        self._done = (bundle, time.monotonic() - started)

    def _show_done(self) -> None:
        if self._done is None:
            return
        (bundle, took), self._done = self._done, None
        self._drawing = None
        self.next_at = self.clock() + max(self.interval, 5 * took)  # drawing: a fifth of the time at most
        try:
            self._show(bundle, final=False)
        except Exception as exc:
            log.warning("the metrics plot is not shown: %s: %s", type(exc).__name__, exc)
            self.live = False

    def _bundle(self, series: Series) -> dict:
        png = base64.b64encode(render(series, self.title)).decode()
        return {"image/png": png, "text/plain": f"{self.title}: {summary(series)}"}

    def _show(self, bundle: dict, final: bool) -> None:
        if hasattr(self.sink, "live"):
            self.sink.live("metrics", bundle, {}, final)
        else:
            self.sink.display(bundle, {})
        self.drawn = True
