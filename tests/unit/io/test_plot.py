"""taas.io.plot: decimation keeps the shape in bounded points; the live plot draws at most once
an interval, in place, and once at the end where displays cannot update; no pyplot state."""

from __future__ import annotations

import logging
import math
import sys
import time

import numpy as np
import pytest

from taas.io import plot


def test_short_series_are_drawn_whole_without_nan():
    x, y = plot.decimate([0, 1, 2, 3], [1.0, math.nan, 3.0, 4.0])
    assert x.tolist() == [0, 2, 3] and y.tolist() == [1.0, 3.0, 4.0]


def test_long_series_keep_at_most_max_points_and_their_extremes():
    n = 100_000
    steps = np.arange(n)
    values = np.sin(steps / 1000.0)
    values[54_321] = 50.0  # a spike
    values[7] = -50.0
    x, y = plot.decimate(steps, values, max_points=2000)
    assert len(x) <= 2000 and len(x) > 1000
    assert 50.0 in y and -50.0 in y
    assert np.all(np.diff(x) > 0)  # in order
    assert x[0] == 0 and x[-1] >= n - 100


def test_render_is_a_png_and_leaves_pyplot_alone():
    had_pyplot = "matplotlib.pyplot" in sys.modules
    series = {f"m{i}": ([0, 1, 2], [1.0, 2.0, math.nan]) for i in range(11)}
    png = plot.render(series, "title")
    assert png.startswith(b"\x89PNG")
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


@pytest.mark.parametrize("scalars", [1, 2, 3, 5])
def test_every_label_is_inside_the_picture_and_steps_are_whole(scalars):
    # One small-valued scalar (a learning rate) had its y tick labels cut off at the left edge.
    steps = list(range(1, 200))
    series = {"lr": (steps, [0.000123 * (1 - i / 200) for i in range(199)]),
              "tokens_per_s": (steps, [12000 + 37.5 * i for i in range(199)]),
              "loss": ([1, 2], [1.0, 0.5]), "acc": (steps, [i / 200 for i in range(199)]),
              "grad_norm": (steps, [1e6 / (i + 1) for i in range(199)])}
    drawn = plot.figure(dict(list(series.items())[:scalars]), "taas metrics (rank 0)")
    drawn.canvas.draw()
    width, height = drawn.canvas.get_width_height()
    def shown(labels, limits, coordinate):  # tick labels past the axis's ends are not drawn
        return [t for t in labels if min(limits) <= t.get_position()[coordinate] <= max(limits)]

    texts = [drawn._suptitle] + [t for axes in drawn.axes for t in (
        axes.title, axes.xaxis.label, axes.yaxis.get_offset_text(),
        *shown(axes.get_xticklabels(), axes.get_xlim(), 0), *shown(axes.get_yticklabels(), axes.get_ylim(), 1))]
    for text in texts:
        if text.get_text() and text.get_visible():
            box = text.get_window_extent()
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, text
    for axes in drawn.axes:
        ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_summary_names_each_last_value():
    assert plot.summary({"loss": ([0, 1, 2], [1.0, 0.5, math.nan]), "acc": ([3], [0.25])}) == \
        "loss 0.5 (step 1), acc 0.25 (step 3)"


class LiveSink:
    def __init__(self, in_place=True):
        self.updates_in_place = in_place
        self.calls = []

    def live(self, name, data, metadata, final):
        self.calls.append((name, final, data["text/plain"]))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def drawn(live):
    """Wait for the drawing in flight (the plot draws in a thread of its own)."""
    if live._drawing is not None:
        live._drawing.join()


def test_live_plot_draws_at_most_once_an_interval_then_once_at_the_end():
    sink, clock = LiveSink(), Clock()
    data = {"loss": ([0], [1.0])}
    live = plot.LivePlot(sink, lambda: data, title="t", interval=1.0, clock=clock)
    live.changed()  # starts a drawing
    drawn(live)
    assert sink.calls == []  # shown by the caller's thread, at its next call
    data["loss"] = ([0, 1], [1.0, 0.5])
    clock.now += 0.5
    live.changed()  # shows the first; too soon for the next
    assert [final for _, final, _ in sink.calls] == [False] and live._drawing is None
    clock.now += 0.6
    live.changed()  # the next drawing starts
    drawn(live)
    live.close()  # (the one in flight is not shown: the final state replaces it)
    assert [final for _, final, _ in sink.calls] == [False, True]
    assert sink.calls[0][2] == "t: loss 1 (step 0)" and sink.calls[-1][2] == "t: loss 0.5 (step 1)"


def test_slow_drawing_is_spaced_out(monkeypatch):
    sink, clock = LiveSink(), Clock()
    live = plot.LivePlot(sink, lambda: {"loss": ([0], [1.0])}, interval=1.0, clock=clock)
    monkeypatch.setattr(time, "monotonic", iter([0.0, 3.0]).__next__)  # a drawing that took 3 s
    live.changed()
    drawn(live)
    monkeypatch.undo()
    live.changed()
    assert live.next_at == clock.now + 15.0


def test_where_displays_cannot_update_the_plot_is_drawn_once_at_the_end():
    sink = LiveSink(in_place=False)
    live = plot.LivePlot(sink, lambda: {"loss": ([0], [1.0])}, clock=Clock())
    for _ in range(5):
        live.changed()
    live.close()
    assert [final for _, final, _ in sink.calls] == [True]


def test_a_text_only_sink_gets_one_line_and_nothing_logged_nothing_shown():
    class TextSink:
        def __init__(self):
            self.lines = []

        def write(self, stream, text):
            self.lines.append((stream, text))

    sink = TextSink()
    live = plot.LivePlot(sink, lambda: {"loss": ([4], [0.125])})
    live.close()
    assert sink.lines == []  # no rows came
    live.changed()
    live.close()
    assert sink.lines == [("stderr", "taas: metrics of rank 0: loss 0.125 (step 4); taas.metrics() has every row\n")]


class Refusing(LiveSink):
    """A front end that refuses every picture."""

    def live(self, *args):
        self.calls.append(args)
        raise ValueError("no")


@pytest.mark.parametrize("failing", ["the front end", "the drawing"])
def test_a_failing_draw_never_fails_the_job(failing, monkeypatch, caplog):
    sink = Refusing() if failing == "the front end" else LiveSink()
    renders = []

    def render(series, title):
        renders.append(title)
        if failing == "the drawing":
            raise ValueError("no")  # as with a broken matplotlib
        return b"png"

    monkeypatch.setattr(plot, "render", render)
    clock = Clock()
    live = plot.LivePlot(sink, lambda: {"loss": ([0], [1.0])}, clock=clock)
    with caplog.at_level(logging.WARNING, logger=plot.log.name):
        live.changed()  # draws (in a thread); the front end refuses it at the next change
        drawn(live)
        live.changed()
        what = "shown" if failing == "the front end" else "drawn"
        assert [r.getMessage() for r in caplog.records] == [f"the metrics plot is not {what}: ValueError: no"]
        assert renders == ["taas metrics (rank 0)"] and len(sink.calls) == (failing == "the front end")
        # The plot is off: later rows, long after (a drawing would be due), start no drawing
        # and show nothing.
        assert not live.live
        for _ in range(3):
            clock.now += 60
            live.changed()
        drawn(live)
        assert len(renders) == 1 and len(sink.calls) == (failing == "the front end")
        # At the end one last try at the final picture, which fails in the same way, logged.
        caplog.clear()
        live.close()
    assert [r.getMessage() for r in caplog.records] == ["the metrics plot is not drawn: ValueError: no"]
    assert len(renders) == 2
