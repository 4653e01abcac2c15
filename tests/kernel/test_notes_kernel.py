"""taas's own notes through a real kernel: few and precise, and told apart from the ranks' stderr.

* the CPU fallback note: once per kernel, on the cell's stdout (not the red stderr);
* "the ranks never communicated": only after ranks trained (backward passes, optimizer steps)
  without a collective; never on cells that print, plot or read a registered loader;
* the layer hint: a job that fails after ranks > 0 wrote files into their layers says so in one
  line, naming the files and ``--storage shared``.
"""

from __future__ import annotations

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
