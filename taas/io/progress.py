"""The data plane's prefetch line, as text: ``taas: loader `train` ██▍······ 12/40 units ready``.

A pure function of the numbers, so tests read it as data; :class:`taas.data.plane.DataPlane`
puts it in the cell as a progress line updated in place (``sink.progress``).  tqdm draws the
bar (eighth blocks, so a few units still move it), with dots for what is still to come: plain
text that reads the same in a notebook, a terminal and a saved ``.ipynb``.
"""

from __future__ import annotations

BAR_WIDTH = 20  # characters
BAR_CHARS = "·▏▎▍▌▋▊▉█"  # tqdm's charset: background, then eighths up to a full block


def bar(n: int, total: int, width: int = BAR_WIDTH) -> str:
    """``width`` characters, filled ``n / total`` (full when ``total`` is 0, clamped to it)."""
    from tqdm import tqdm  # here: the kernel pays for the import only when a loader is served

    if total <= 0:
        return BAR_CHARS[-1] * width
    n = min(max(n, 0), total)
    return tqdm.format_meter(n, total, 0, bar_format=f"{{bar:{width}}}", ascii=BAR_CHARS)


def prefetch_line(loader: str, ready: int, total: int, started: bool = False) -> str:
    """The line for ``loader`` with ``ready`` of ``total`` units ready; ``started``: the ranks
    have started (prefetch is done) while loading goes on."""
    text = f"taas: loader `{loader}` {bar(ready, total)} {ready}/{total} units ready"
    return text + "; ranks start, loading goes on" if started else text
