"""taas as a JupyterLab user sees it: cells run in headless Chromium, outputs read from the DOM.

One notebook (one kernel) for the module; each test appends its cells.  Tests wait for what the
page shows, never for a fixed time: a cell that must still be running when the test looks waits
for a file the test writes.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest

from tests.support.jupyterlab import wait_for
from tests.support.kernel_driver import cell

pytestmark = pytest.mark.browser

# A line as a rank prints it in a multi-rank cell: tagged with its rank or (collapsed) ranks.
TAG = r"\[rank[\d,\-]+\] "


def test_output_shows_live_while_the_cell_runs(notebook, lab):
    # Outside the notebook's working directory: what is created there while a job runs is not
    # what ranks other than 0 see (their storage layer); rank 0 waits, the others at a barrier.
    go = os.path.join(lab.tmp, "live-go")
    index = notebook.run(cell(f"""
        %%taas --gpus 2
        import os, time
        import torch.distributed as dist
        print("first line", flush=True)
        deadline = time.monotonic() + 300
        while dist.get_rank() == 0 and not os.path.exists({go!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
        print("second line", flush=True)
        """))
    notebook.wait_for_text(index, TAG + "first line")
    # The ranks wait for the file this test has not written yet: the cell is still running.
    assert notebook.running(index)
    assert "second line" not in notebook.text(index)
    open(go, "w").close()
    done = notebook.wait_done(index)
    text = "\n".join(o["text"] for o in done["outputs"])
    assert re.search(TAG + "second line", text), text
    assert text.index("first line") < text.index("second line")
    assert not any(o["mime"] == "application/vnd.jupyter.error" for o in done["outputs"]), text


def test_the_toolbar_interrupt_stops_the_job_and_the_next_cell_runs(notebook):
    index = notebook.run("%%taas --gpus 2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    notebook.wait_for_text(index, TAG + "sleeping")
    notebook.interrupt_button().click()
    done = notebook.wait_done(index, timeout=60)
    errors = [o["text"] for o in done["outputs"] if o["mime"] == "application/vnd.jupyter.stderr"]
    assert any("KeyboardInterrupt" in text for text in errors), done
    after = notebook.run_done("%%taas --gpus 2\nimport torch.distributed as dist\nprint('after', dist.get_rank())")
    text = "\n".join(o["text"] for o in after["outputs"])
    assert re.search(r"\[rank0[^\]]*\] after 0", text) and re.search(r"\[rank[^\]]*1\] after 1", text), text
    assert "KeyboardInterrupt" not in text


def test_rank_zeros_figure_renders_as_an_image(notebook):
    done = notebook.run_done(cell("""
        %%taas --gpus 2
        import matplotlib.pyplot as plt
        import torch.distributed as dist
        plt.plot([1, 3, 2, 4], label=f"rank {dist.get_rank()}")
        plt.legend()
        plt.show()
        """))
    images = [image for o in done["outputs"] for image in o["images"]]
    assert len(images) == 1, done  # rank 0's figure only
    image = notebook.wait_for_image(notebook.last)
    assert image["src"].startswith("data:image/png") and image["width"] > 100 and image["height"] > 100, image


def test_a_registered_loaders_prefetch_bar_renders(notebook):
    setup = notebook.run_done(cell("""
        import taas, time, torch
        from torch.utils.data import DataLoader, Dataset

        class Slow(Dataset):
            def __len__(self):
                return 48
            def __getitem__(self, i):
                time.sleep(0.02)
                return torch.full((4,), float(i))

        batches = DataLoader(Slow(), batch_size=4)
        taas.register(batches)
        """))
    assert setup["outputs"] == [], setup
    done = notebook.run_done(cell("""
        %%taas --gpus 2 --cpus 1
        seen = sum(len(b) for b in batches)
        print("samples", seen)
        """))
    bars = [o["text"] for o in done["outputs"] if "units ready" in o["text"]]
    # One line updated in place (not one per update): the loader, a bar, units ready / K.
    assert len(bars) == 1, done
    # It shows the units ready when the ranks started (a first slice, or all 12 of a quick pass).
    ready = re.search(r"taas: loader `batches` [·▏▎▍▌▋▊▉█]{20} (\d+)/12 units ready", bars[0])
    assert ready and 1 <= int(ready.group(1)) <= 12, bars
    text = "\n".join(o["text"] for o in done["outputs"])
    assert re.search(r"\[rank0[^\]]*\] samples 24", text), text


# Each output of a cell: its live rank panel (title and table rows as text) or None.
_PANELS = """
const [path, index] = arguments;
const node = window.__taasNotebooks[path].content.widgets[index].node;
return [...node.querySelectorAll('.jp-OutputArea-output')].map((o) => {
  const panel = o.querySelector('.taas-panel');
  return panel && {title: panel.firstElementChild.textContent,
                   rows: [...panel.querySelectorAll('tr')].map((r) => [...r.children].map((c) => c.textContent))};
});
"""


def _panels(notebook, index: int) -> list:
    return notebook.driver.execute_script(_PANELS, notebook.path, index)


# Where the text of the panel's title, of its first header cell, and of the cell's first
# printed line starts, in pixels from the page's left (rounded).
_LEFTS = """
const [path, index] = arguments;
const node = window.__taasNotebooks[path].content.widgets[index].node;
const panel = node.querySelector('.taas-panel');
const printed = [...node.querySelectorAll('.jp-OutputArea-output')].find((o) => !o.querySelector('.taas-panel'));
const left = (element) => {
  const range = document.createRange();
  range.selectNodeContents(element);
  return Math.round(range.getClientRects()[0].left);
};
return [left(panel.firstElementChild), left(panel.querySelector('th')), left(printed.querySelector('pre') || printed)];
"""


def _text_lefts(notebook, index: int) -> list:
    return notebook.driver.execute_script(_LEFTS, notebook.path, index)


def _rows(panel: dict) -> dict:
    """A panel's rank rows by rank: column name -> text."""
    header, *rows = panel["rows"]
    return {row[0]: dict(zip(header, row)) for row in rows if row[0].startswith("rank")}


_GO = itertools.count()


@pytest.fixture
def go(lab):
    """A file whose creation lets the test's ranks go on (outside the working directory, as in
    the first test); made at the end in any case, so that a failed test's cell ends and the
    next test's cells run."""
    path = os.path.join(lab.tmp, f"go-{next(_GO)}")
    yield path
    open(path, "a").close()


def test_the_rank_panel_updates_in_place_then_gives_way_to_its_summary(notebook, go, snap):
    # Cell lines: the directive is line 1, rank 0 loops on lines 6-7, rank 1 waits on line 8.
    index = notebook.run(cell(f"""
        %%taas --gpus 2
        import os, time
        import torch.distributed as dist
        print("ranks started", flush=True)
        go, deadline = {go!r}, time.monotonic() + 300
        while dist.get_rank() == 0 and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
        print("ranks released", flush=True)
        """))

    def settled():
        # The panel once both ranks' beats are in: rank 0 in its loop, rank 1 in the barrier.
        shown = [p for p in _panels(notebook, index) if p]
        rows = _rows(shown[0]) if shown else {}
        if set(rows) == {"rank0", "rank1"} and rows["rank0"]["state"] == "running" and (
                rows["rank1"]["state"] == "waiting"):
            return shown[0]
        return None

    first = wait_for(settled, 300, "the rank panel with both ranks in the cell")
    assert notebook.running(index)
    rows = _rows(first)
    assert rows["rank0"]["line"] in ("6", "7") and rows["rank1"]["line"] == "8", first
    assert rows["rank1"]["call"] == "barrier", first
    assert re.fullmatch(r"taas: 2 ranks, [\d.]+ s into the job", first["title"]), first
    assert all(re.fullmatch(r"\d+(\.\d)? [kMG]?B", r["RSS"]) for r in rows.values()), first
    # Its title, its table and the cell's printed lines start at one left edge.
    assert len(set(_text_lefts(notebook, index))) == 1, _text_lefts(notebook, index)
    snap("mid-job")
    # Updated in place: a later refresh has another title, and is still the cell's one panel,
    # in the same output area.
    at = _panels(notebook, index).index(first)
    later = wait_for(lambda: (p := _panels(notebook, index)) and p[at] and p[at]["title"] != first["title"] and p,
                     60, "the panel refreshed")
    assert sum(1 for p in later if p) == 1, later
    open(go, "w").close()
    done = notebook.wait_done(index)
    texts = [o["text"] for o in done["outputs"]]
    assert not any(_panels(notebook, index)), texts  # the table is gone ...
    summary = [t for t in texts if t.startswith("taas: 2 ranks")]
    assert len(summary) == 1 and re.fullmatch(r"taas: 2 ranks, [\d.]+ s: done 2\s*", summary[0]), texts
    assert texts.index(summary[0]) == at, texts  # ... for its one line, in the panel's place
    assert re.search(TAG + "ranks released", "\n".join(texts)), texts


def test_the_metrics_plot_renders_live_and_taas_metrics_shows_every_row(notebook, go, snap):
    index = notebook.run(cell(f"""
        %%taas --gpus 2
        import os, time, taas
        go, step, deadline = {go!r}, 0, time.monotonic() + 300
        while not os.path.exists(go) and time.monotonic() < deadline:
            if step < 450:  # rows enough for a plot; a list of them still prints whole
                step += 1
                taas.log(step=step, loss=1.0 / step)
            time.sleep(0.1)
        taas.log(step=step + 1, loss=0.0)
        print("logged", step + 1, flush=True)
        """))
    # A live plot while the ranks still log: rank 0's scalars drawn as a PNG in the cell.
    image = notebook.wait_for_image(index, timeout=300)
    assert notebook.running(index)
    assert image["src"].startswith("data:image/png") and image["width"] > 100 and image["height"] > 100, image
    assert _colours(notebook, index) > 8  # drawn, not a blank picture
    snap("live")
    open(go, "w").close()
    done = notebook.wait_done(index)
    images = [i for o in done["outputs"] for i in o["images"]]
    assert len(images) == 1, done  # one plot, updated in place
    # Rows each rank logged (the ranks see the file at different steps: "[rank0] logged 15",
    # "[rank1] logged 16", or one collapsed "[rank0-1] logged 15").
    logged = re.findall(r"\[rank(0|1|0-1)\] logged (\d+)", "\n".join(o["text"] for o in done["outputs"]))
    rows_logged = sum(int(n) * (2 if tag == "0-1" else 1) for tag, n in logged)
    assert sorted(t for tag, _ in logged for t in tag.split("-")) == ["0", "1"], done
    assert not any(o["mime"] == "application/vnd.jupyter.error" for o in done["outputs"]), done

    table = notebook.run_done("taas.metrics()")
    text = "\n".join(o["text"] for o in table["outputs"])
    # Every row of both ranks: a DataFrame's table where pandas is installed, else its text.
    header = notebook.driver.execute_script(
        "const n = window.__taasNotebooks[arguments[0]].content.widgets[arguments[1]].node"
        ".querySelector('table.dataframe'); return n && [...n.querySelectorAll('thead th')]"
        ".map((c) => c.textContent);", notebook.path, notebook.last)
    if header is not None:
        assert [h for h in header if h] == ["step", "rank", "loss"], header
        assert re.search(rf"{rows_logged} rows", text), text
    else:
        rows = re.findall(r"\{'step': (\d+), 'rank': (\d), 'loss': ", text)
        assert len(rows) == rows_logged and {r for _, r in rows} == {"0", "1"}, text


# How many distinct colours a grid of the cell's first image's pixels has (a blank plot: 1).
_COLOURS = """
const [path, index] = arguments;
const img = window.__taasNotebooks[path].content.widgets[index].node.querySelector('.jp-OutputArea-output img');
const canvas = document.createElement('canvas');
[canvas.width, canvas.height] = [img.naturalWidth, img.naturalHeight];
const context = canvas.getContext('2d');
context.drawImage(img, 0, 0);
const data = context.getImageData(0, 0, canvas.width, canvas.height).data, seen = new Set();
for (let y = 0; y < canvas.height; y += 3)
  for (let x = 0; x < canvas.width; x += 3) {
    const i = 4 * (y * canvas.width + x);
    seen.add(`${data[i]},${data[i + 1]},${data[i + 2]}`);
  }
return seen.size;
"""


def _colours(notebook, index: int) -> int:
    return notebook.driver.execute_script(_COLOURS, notebook.path, index)


def test_pdb_in_a_rank_reads_what_is_typed_into_the_pages_input_box(notebook, snap):
    from selenium.webdriver.common.keys import Keys

    index = notebook.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        secret = 40 + dist.get_rank()
        if dist.get_rank() == 1:
            breakpoint()
        dist.barrier()
        print("went on", secret)
        """))
    box, prompt = notebook.input_box(index)
    assert prompt.strip() == "(Pdb) [rank1]", prompt
    box.send_keys("p secret * 1000" + Keys.ENTER)
    notebook.wait_for_text(index, re.escape("[rank1] 41000"))
    snap("pdb")
    box, prompt = notebook.input_box(index)  # the next prompt: a box of its own
    assert prompt.strip() == "(Pdb) [rank1]", prompt
    box.send_keys("c" + Keys.ENTER)
    done = notebook.wait_done(index)
    text = "\n".join(o["text"] for o in done["outputs"])
    assert "[rank0] went on 40" in text and "[rank1] went on 41" in text, text
    assert not any(o["mime"] == "application/vnd.jupyter.error" for o in done["outputs"]), text
