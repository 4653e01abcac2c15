"""taas's own notes through a real kernel: few and precise, and told apart from the ranks' stderr.

* the CPU fallback note: once per kernel, on the cell's stdout (not the red stderr);
* "the ranks never communicated": only after ranks trained (backward passes, optimizer steps)
  without a collective; never on cells that print, plot or read a registered loader;
* the layer hint: a job that fails after ranks > 0 wrote files into their layers says so in one
  line, naming the files and ``--storage shared``;
* the unseen hint: a job that fails on a missing file, or is interrupted, while files were written
  in the working directory itself names them (ranks > 0 do not see a file created after they
  looked for it).
"""

from __future__ import annotations

import re

import pytest

from tests.support.kernel_driver import OFFLINE, cell, plain

pytestmark = pytest.mark.kernel

KERNEL_ENV = OFFLINE  # the module's kernel (tests/conftest.py) runs offline

FALLBACK = "taas: no CUDA device here: running"
ALONE = "never communicated"


def test_the_cpu_fallback_note_shows_once_per_kernel_on_stdout(kernel, clean):
    first = kernel.run("%%taas --gpus 2\nprint('one')")
    assert first.error is None, first.traceback
    assert first.stdout.count(FALLBACK) == 1 and FALLBACK not in first.stderr, first.stdout + first.stderr
    assert "taas: no CUDA device here: running 2 CPU ranks on gloo\n" in first.stdout
    for line in ("%%taas --gpus 2\nprint('two')", "%%taas --gpus 3\nprint('three')"):
        again = kernel.run(line)  # the same fact (another N is not another decision): silent
        assert again.error is None, again.traceback
        assert FALLBACK not in again.stdout + again.stderr, again.stdout + again.stderr


def test_cells_that_do_not_train_get_no_communication_warning(kernel, clean):
    printing = kernel.run("%%taas --gpus 2\nimport torch\nmodel = torch.nn.Linear(2, 1)\nprint('hi')")
    assert printing.error is None, printing.traceback
    assert ALONE not in printing.stderr + printing.stdout, printing.stderr
    plotting = kernel.run(cell("""
        %%taas --gpus 2
        import matplotlib.pyplot as plt
        plt.plot([1, 2, 3])
        plt.show()
        """))
    assert plotting.error is None, plotting.traceback
    assert ALONE not in plotting.stderr + plotting.stdout, plotting.stderr


def test_ranks_that_train_without_collectives_are_warned_on_stderr(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad(); model(torch.ones(4, 2)).sum().backward(); opt.step()
        """))
    assert run.error is None, run.traceback
    notes = [line for line in run.stderr.splitlines() if ALONE in line]
    assert len(notes) == 1, run.stderr
    assert notes[0].startswith("taas: the 2 ranks never communicated")
    assert "while they trained (6 backward passes and 6 optimizer steps in all)" in notes[0]


def test_ranks_that_train_with_ddp_are_not_warned(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(torch.nn.Linear(2, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad(); model(torch.ones(4, 2)).sum().backward(); opt.step()
        """))
    assert run.error is None, run.traceback
    assert ALONE not in run.stderr + run.stdout, run.stderr


def test_a_failed_job_names_what_other_ranks_wrote_into_their_layers(kernel, clean, workdir):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        if dist.get_rank() == 1:
            with open("handoff.txt", "w") as f:
                f.write("from rank 1")
            raise RuntimeError("rank 1 gave up")
        """))
    assert run.error is not None and "rank 1 gave up" in run.error["evalue"], run.stderr
    hints = [line for line in plain(run.stderr).splitlines() if "into a layer of its own" in line]
    assert len(hints) == 1, run.stderr
    assert hints[0].startswith("taas: rank1 wrote handoff.txt into a layer of its own"), hints
    assert "could not see these files while the job ran" in hints[0] and "--storage shared" in hints[0]
    assert (workdir / "handoff.txt").read_text() == "from rank 1"  # merged back after the job


def test_a_file_created_after_rank_1_looked_for_it_gets_the_unseen_hint(kernel, clean, workdir):
    # A user's report: rank 1 could not see a file created in the working directory while the
    # job ran.  Its layer remembers that the name was not there when it first looked (rank 0's
    # file, the notebook's alike): by design of the layer, said in one line when the job fails.
    run = kernel.run(cell("""
        %%taas --gpus 2
        import os
        import torch.distributed as dist
        seen_before = os.path.exists("made-during-job.txt")
        dist.barrier()
        if dist.get_rank() == 0:
            with open("made-during-job.txt", "w") as f:
                f.write("from rank 0")
        dist.barrier()
        if dist.get_rank() == 1:
            open("made-during-job.txt").read()
        """))
    assert run.error is not None, run.stdout
    assert "rank1 failed: FileNotFoundError" in plain(run.traceback), run.traceback
    hints = [line for line in plain(run.stderr).splitlines() if "while the job ran: a rank other than 0" in line]
    assert len(hints) == 1, run.stderr
    assert hints[0].startswith("taas: made-during-job.txt was written in the working directory"), hints
    assert "--storage shared" in hints[0]
    assert (workdir / "made-during-job.txt").read_text() == "from rank 0"
    shared = kernel.run(cell("""
        %%taas --gpus 2 --storage shared
        import os
        import torch.distributed as dist
        seen_before = os.path.exists("made-in-shared.txt")
        dist.barrier()
        if dist.get_rank() == 0:
            with open("made-in-shared.txt", "w") as f:
                f.write("from rank 0")
        dist.barrier()
        print(open("made-in-shared.txt").read())
        """))
    assert shared.error is None, shared.traceback  # what the hint offers works


def test_interrupting_ranks_that_wait_for_a_file_the_notebook_made_gets_the_unseen_hint(kernel, clean, workdir):
    # The report as the user hit it: the notebook's side creates a file while rank 1 polls for it.
    seen = {}

    def on_output(out):
        text = out.stdout
        if re.search(r"\[rank(0-1|0,1|1)\] looking", text) and "made" not in seen:  # collapsed or not
            seen["made"] = (workdir / "from-notebook.flag").write_text("go")
        if "[rank0] sees it" in text and "interrupted" not in seen:
            seen["interrupted"] = True  # rank 1 looked before the file came: it never will
            kernel.km.interrupt_kernel()

    run = kernel.run(cell("""
        %%taas --gpus 2
        import os, time
        import torch.distributed as dist
        deadline = time.monotonic() + 120
        print("looking", flush=True)
        while not os.path.exists("from-notebook.flag") and time.monotonic() < deadline:
            time.sleep(0.05)
        print("sees it" if os.path.exists("from-notebook.flag") else "gave up", flush=True)
        """), on_output=on_output)
    assert seen.get("interrupted"), run.stdout
    assert run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.stdout
    assert "[rank1] sees it" not in run.stdout, run.stdout
    hints = [line for line in plain(run.stderr).splitlines() if "while the job ran: a rank other than 0" in line]
    assert len(hints) == 1 and hints[0].startswith("taas: from-notebook.flag was written"), run.stderr


def test_a_succeeding_job_gets_no_layer_hint(kernel, clean, workdir):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        if dist.get_rank() == 1:
            with open("quiet.txt", "w") as f:
                f.write("fine")
        """))
    assert run.error is None, run.traceback
    assert "into a layer of its own" not in run.stderr, run.stderr
    assert (workdir / "quiet.txt").read_text() == "fine"


def test_accelerates_test_script_under_the_default_layer_gets_the_hint(kernel, clean, workdir):
    """accelerate's ``process_execution_check`` has every rank append to one file and the main
    process read it back: under the default layer it fails with only "Main process was not
    first"; the hint says why and what to use instead."""
    run = kernel.run(cell("""
        %%taas --gpus 2
        from accelerate.test_utils.scripts.test_script import process_execution_check
        process_execution_check()
        """))
    assert run.error is not None, run.stdout + run.stderr
    hints = [line for line in plain(run.stderr).splitlines() if "layer of its own" in line]
    assert len(hints) == 1 and "check_main_process_first.txt" in hints[0], run.stderr
    assert "--storage shared" in hints[0]
