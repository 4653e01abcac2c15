"""taas as a JupyterLab user sees it: cells run in headless Chromium, outputs read from the DOM.

One notebook (one kernel) for the module; each test appends its cells.  Tests wait for what the
page shows, never for a fixed time: a cell that must still be running when the test looks waits
for a file the test writes.
"""

from __future__ import annotations

import os
import re

import pytest

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
