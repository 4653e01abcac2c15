"""Faults users met, each reproduced through a real Jupyter kernel: pragma look-alikes, long
output, a deleted working directory, a registered loader assigned again."""

from __future__ import annotations


import pytest

from tests.support.kernel_driver import Kernel, cell
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module", autouse=True)
def _cpu_note_shown(kernel):
    """Without CUDA a kernel's first taas cell carries the CPU-fallback note (once per kernel, on
    stdout); these tests read a cell's whole stdout, so a first cell shows the note before them."""
    kernel.run("%%taas --gpus 1\npass")


# -- 1: only a real directive line is a directive ------------------------------------------------
@pytest.mark.parametrize("code", [
    's = """\n#pragma taas --gpus 2\n"""\nimport os\nprint("plain", os.getpid(), len(s))',
    'import os\n# pragma taas is great\nprint("plain", os.getpid())',
])
def test_pragma_look_alikes_run_as_plain_cells(kernel, code):
    pid = kernel.run("import os; print(os.getpid())").stdout.strip()
    run = kernel.run(code)
    assert run.error is None, run.traceback
    assert run.stdout.startswith(f"plain {pid}")  # in the kernel itself, no ranks


def test_a_real_pragma_on_a_later_line_is_still_refused(kernel):
    run = kernel.run('x = 1\n#pragma taas --gpus 2\nprint("ran")')
    assert run.status == "error"  # a transformer's UsageError is shown on stderr
    assert "must be the first line of the cell (line 2 here)" in run.stderr and "ran" not in run.stdout


# -- 6: output cost stays linear; long lines and progress bars arrive whole ----------------------
def test_a_long_line_without_newline_arrives_live_complete_and_once(kernel, clean, tmp_path):
    # Rank 0 writes 5 MB without a newline and ends the line only once the notebook has shown
    # most of it (all but the last piece, under 1 Mi characters): a router that holds a line
    # until its newline never gets there.
    seen = tmp_path / "seen"

    def on_output(out):
        if not seen.exists() and out.stdout.count("A") >= 4_000_000:
            seen.touch()

    run = kernel.run(cell(f"""
        %%taas --gpus 2
        import os, sys, time, torch.distributed as dist
        if dist.get_rank() == 0:
            sys.stdout.write("A" * 5_000_000)
            sys.stdout.flush()
            deadline = time.monotonic() + 120  # only a failure waits this long
            while not os.path.exists({str(seen)!r}):
                if time.monotonic() > deadline:
                    raise SystemExit("the notebook never showed the line")
                time.sleep(0.05)
            sys.stdout.write("B" * 10 + "\\n")
            sys.stdout.flush()
        dist.barrier()
        print("after")
        """), on_output=on_output)
    assert run.error is None, run.traceback
    lines = run.stdout.splitlines()
    long = [line for line in lines if "A" in line]
    assert len(long) == 1, [line[:40] for line in long]
    assert long[0] == "[rank0] " + "A" * 5_000_000 + "B" * 10  # tagged once, whole
    assert per_rank(run.stdout).count("[rank0] after") == 1 and per_rank(run.stdout).count("[rank1] after") == 1


BAR = "import sys\nfor i in range(1, 10001):\n    sys.stderr.write(f'\\rstep {i}/10000')\n"


def test_a_long_progress_bar_ends_with_its_final_state(kernel, clean):
    # Correctness only: that its cost does not grow with its length (the old router re-scanned
    # every state it had kept at each read) is tests/unit/io/test_output.py's, on the splitter itself.
    run = kernel.run("%%taas --gpus 1\n" + BAR + "sys.stderr.write('\\n')\nprint('done')")
    assert run.error is None, run.traceback
    texts = [data.get("text/plain", "") for _, data in run.displays]
    assert texts and texts[-1] == "step 10000/10000"
    assert "step" not in run.stderr and run.stdout == "done\n"


# -- 7: a deleted working directory is one line --------------------------------------------------
def test_a_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    k = Kernel(str(gone))
    try:
        gone.rmdir()
        run = k.run("%%taas --gpus 2\nprint('ran')")
        assert run.status == "error"  # IPython shows a UsageError as one line on stderr
        assert run.stderr == (
            f"UsageError: the notebook's working directory {gone} no longer exists; `%cd` to an "
            "existing directory and run the cell again\n")
        assert "ran" not in run.stdout
        assert k.run(f"%cd {tmp_path}").error is None
        again = k.run("%%taas --gpus 2\nprint('ran')")
        assert again.error is None, again.traceback
        assert "[rank0] ran" in per_rank(again.stdout)
    finally:
        k.shutdown()


# -- 8: a registered loader assigned again gets a note -------------------------------------------
def test_a_registered_loader_assigned_again_gets_a_note(kernel, clean):
    setup = kernel.run(cell("""
        import taas
        from torch.utils.data import DataLoader
        loader = DataLoader(list(range(8)), batch_size=2)
        taas.register(loader)
        loader = DataLoader(list(range(6)), batch_size=3)
        """))
    assert setup.error is None, setup.traceback
    body = "%%taas --gpus 2\nprint(type(loader).__name__, len(list(loader)))"
    run = kernel.run(body)
    assert run.error is None, run.traceback
    assert run.stderr.count("`loader` is no longer the loader registered") == 1, run.stderr
    assert "taas.register(loader)" in run.stderr
    assert "[rank0] DataLoader 2" in per_rank(run.stdout)  # the new plain loader, as the note says
    again = kernel.run(body)
    assert "no longer" not in again.stderr  # noted once per re-definition
    fixed = kernel.run("taas.register(loader)\n" + "get_ipython().run_cell_magic('taas', '--gpus 2', "
                       "'print(len(list(loader)))')")
    assert fixed.error is None, fixed.traceback
    assert "no longer" not in fixed.stderr
    assert "[rank0] 1\n" in per_rank(fixed.stdout)  # a view: this rank's share of the 2 batches
