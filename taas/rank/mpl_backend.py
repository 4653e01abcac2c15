"""A matplotlib backend for ranks: Agg rendering, ``show()`` sends figures to the notebook."""

from __future__ import annotations

import base64
import io

from matplotlib.backend_bases import _Backend
from matplotlib.backends.backend_agg import FigureCanvasAgg, _BackendAgg

from taas.rank import display
from taas.launch.process import events


@_Backend.export
class _BackendTaas(_BackendAgg):
    FigureCanvas = FigureCanvasAgg

    @staticmethod
    def show(*args, **kwargs):
        import matplotlib.pyplot as plt

        for num in plt.get_fignums():
            figure = plt.figure(num)
            if display._rank == 0:
                buffer = io.BytesIO()
                figure.savefig(buffer, format="png", bbox_inches="tight")
                png = base64.b64encode(buffer.getvalue()).decode()
                events.send("display", data={"image/png": png, "text/plain": repr(figure)}, metadata={})
        plt.close("all")
