"""The live rank panel in a real kernel (taas.io.board): a display updated in place where the
front end asks as JupyterLab does, nothing for short cells, nothing in a batch run's outputs."""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import cell
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel

# Rank 0 sits in a function of the cell for 5 s while rank 1 waits in the barrier for it.
SLOW = cell("""
    %%taas --gpus 2
    import time
    import torch.distributed as dist

    def slow_step():
        time.sleep(5)

    if dist.get_rank() == 0:
        slow_step()
    dist.barrier()
    print("done")
    """)


def test_a_live_panel_shows_each_rank_then_gives_way_to_one_line(kernel, clean):
    run = kernel.run(SLOW)
    assert run.error is None, run.traceback
    assert "[rank0] done" in per_rank(run.stdout) and "[rank1] done" in per_rank(run.stdout)
    kinds = [kind for kind, _ in run.panels]
    assert kinds and kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}
    texts = [data["text/plain"] for _, data in run.panels]
    tables = [t for t in texts[:-1] if "rank0" in t]
    assert tables, texts
    assert all("<table" in data["text/html"] for _, data in run.panels[:-1])
    rows = [line.split() for t in tables for line in t.splitlines()]
    # The cell's own line numbers (the magic is line 1): the innermost line, in slow_step.
    assert ["rank0", "running", "6", "slow_step"] in [r[:4] for r in rows], tables[-1]
    assert ["rank1", "waiting", "10", "barrier"] in [r[:4] for r in rows], tables[-1]
    assert any("RSS" in t and "MB" in t for t in tables)
    assert texts[-1].startswith("taas: 2 ranks, ") and texts[-1].endswith(": done 2"), texts[-1]
    assert run.displays == []  # nothing else became a display
    assert "state" not in run.stderr and "state" not in run.stdout  # no text panel as well


def test_a_short_cell_gets_no_panel(kernel, clean):
    run = kernel.run("%%taas --gpus 2\nprint('quick')")
    assert run.error is None, run.traceback
    assert run.panels == [] and run.displays == []
    assert "[rank0] quick" in per_rank(run.stdout)


def test_a_batch_run_as_nbval_sends_it_gets_no_panel(kernel, clean):
    run = kernel.run(SLOW, batch=True)
    assert run.error is None, run.traceback
    assert run.panels == [] and run.displays == []
    assert "rank0  " not in run.stderr and "into the job" not in run.stderr


def test_loader_workers_have_rows(kernel, clean):
    setup = kernel.run(cell("""
        import time
        import taas
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(torch.arange(40.0)), batch_size=2)
        taas.register(loader)
        """))
    assert setup.error is None, setup.traceback
    try:
        run = kernel.run(cell("""
            %%taas --gpus 2 --cpus 1
            import time
            for batch in loader:
                time.sleep(0.3)
            """))
        assert run.error is None, run.traceback
        texts = [data["text/plain"] for _, data in run.panels]
        rows = [line.split() for t in texts for line in t.splitlines() if line.startswith("loader:loader:0")]
        assert rows, texts
        assert any(r[2].isdigit() and int(r[2]) > 0 and r[3] == "units" for r in rows), rows
        assert any(r[4:6] == ["data", "wait"] for r in rows), rows
    finally:
        kernel.run("taas.unregister(loader)")
