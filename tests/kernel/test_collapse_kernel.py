"""End to end: many ranks, one readable cell (issue 17, item 1).

A line several ranks print identically shows once, tagged with those ranks; distinct lines stay
per rank; each rank's lines keep their order; the lines show while the job runs; other ranks'
progress bars that match rank 0's merge into it; one rank prints untagged.
"""

from __future__ import annotations

import re

import pytest

from tests.support.kernel_driver import cell
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module", autouse=True)
def _cpu_note_shown(kernel):
    """Without CUDA a kernel's first taas cell carries the CPU-fallback note (once per kernel, on
    stdout); these tests read a cell's whole stdout, so a first cell shows the note before them."""
    kernel.run("%%taas --gpus 1\npass")


def test_identical_lines_show_once_with_their_ranks(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 4
        import torch.distributed as dist
        r = dist.get_rank()
        for epoch in range(3):
            dist.barrier()  # the ranks print together, as after a training step
            print(f"epoch {epoch} done", flush=True)
            print(f"loss {r}.{epoch}", flush=True)
            if r % 2:
                print(f"odd rank, epoch {epoch}", flush=True)
        """))
    assert run.error is None, run.traceback
    lines = run.stdout.splitlines()
    for epoch in range(3):
        assert lines.count(f"[rank0-3] epoch {epoch} done") == 1, run.stdout
        assert lines.count(f"[rank1,3] odd rank, epoch {epoch}") == 1, run.stdout
        for r in range(4):
            assert lines.count(f"[rank{r}] loss {r}.{epoch}") == 1, run.stdout
    assert len(lines) == 3 * (1 + 4 + 1), run.stdout
    # Each rank's own lines, read back per rank, are in the order it printed them.
    for r in range(4):
        mine = [line.split("] ", 1)[1] for line in per_rank(run.stdout).splitlines()
                if line.startswith(f"[rank{r}] ")]
        expected = []
        for epoch in range(3):
            expected += [f"epoch {epoch} done", f"loss {r}.{epoch}"]
            expected += [f"odd rank, epoch {epoch}"] if r % 2 else []
        assert mine == expected, run.stdout


def test_collapsed_lines_show_while_the_job_runs(kernel, clean, tmp_path):
    mark = tmp_path / "seen"
    seen = {}

    def on_output(out):
        if "[rank0-1] waiting" in out.stdout and "live" not in seen:
            seen["live"] = True
            mark.touch()

    run = kernel.run(cell(f"""
        %%taas --gpus 2
        import os, time
        print("waiting", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(mark)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
        print("seen" if os.path.exists({str(mark)!r}) else "never seen")
        """), on_output=on_output)
    assert run.error is None, run.traceback
    assert seen.get("live"), run.stdout
    assert "[rank0-1] seen" in run.stdout, run.stdout


def test_other_ranks_progress_bars_merge_into_rank_zeros(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 3
        import sys, time, torch.distributed as dist
        dist.barrier()
        for i in range(1, 21):
            sys.stderr.write(f"\\rstep {i}/20")
            sys.stderr.flush()
            time.sleep(0.02)
        sys.stderr.write("\\n")
        print("done")
        """))
    assert run.error is None, run.traceback
    assert "step" not in run.stderr  # not flooded into the stream
    texts = [data.get("text/plain", "") for _, data in run.displays]
    bars = [t for t in texts if re.search(r"step \d+/20", t)]
    assert bars and bars[-1] == "[rank0-2] step 20/20", texts
    assert all(t.startswith("[rank0") for t in bars), texts  # no bar of rank 1 or 2 on its own
    assert "[rank0-2] done" in run.stdout


def test_one_rank_prints_untagged(kernel, clean):
    run = kernel.run("%%taas --gpus 1\nprint('epoch done')\nprint('epoch done')")
    assert run.error is None, run.traceback
    assert run.stdout == "epoch done\nepoch done\n"
