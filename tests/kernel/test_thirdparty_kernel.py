"""What real users hit first, through a real kernel: notebook code written for plain scripts and
third-party libraries (IPython's exit, Hugging Face, accelerate, Lightning Fabric), ranks that
never talk, results that cannot come back, a rank that leaves early."""

from __future__ import annotations

import re

import pytest

from tests.support.kernel_driver import OFFLINE, cell, one_line_usage_error, plain
from tests.support.notebooks import tiny_bert_notebook
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


KERNEL_ENV = OFFLINE  # the module's kernel (tests/conftest.py) runs offline


# -- A1: IPython's exit / quit / get_ipython in notebook functions -----------------------------
def test_notebook_functions_using_exit_quit_and_get_ipython_run_in_ranks(kernel, clean):
    setup = kernel.run(cell("""
        import torch
        def verify_min_gpu_count(min_gpus=2):
            return torch.cuda.is_available() and torch.cuda.device_count() >= min_gpus
        def main(args):
            if not verify_min_gpu_count(2):
                print("Unable to locate sufficient 2 gpus to run this example. Exiting.")
                exit()
            print("trained")
        def in_notebook():
            return get_ipython() is not None
        """))
    assert setup.error is None, setup.traceback
    run = kernel.run("%%taas --gpus 2\nprint('shell:', in_notebook(), get_ipython())\nmain(None)")
    assert run.error is None, run.traceback
    out = per_rank(run.stdout)
    assert "[rank0] shell: False None" in out and "[rank1] shell: False None" in out
    assert "[rank1] Unable to locate sufficient 2 gpus" in out and "trained" not in out
    assert kernel.run("print(in_notebook())").stdout.strip() == "True"  # the kernel's own is untouched


def test_quit_in_a_notebook_function_ends_the_rank_as_sys_exit_does(kernel, clean):
    kernel.run("def leave(code):\n    quit(code)")
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        if dist.get_rank() == 1:
            leave(3)
        dist.barrier()
        """))
    assert run.status == "error"
    tb = plain(run.traceback)
    assert "rank1 exited with code 3" in tb, tb
    assert "leave(3)" in tb  # where the rank left, in the user's cell


def test_unshippable_global_of_a_function_gets_advice_that_fits(kernel):
    kernel.run("import threading\nlock = threading.Lock()\ndef work():\n    with lock:\n        return 1")
    run = kernel.run("%%taas --gpus 2\nwork()")
    assert run.status == "error"
    usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError: ")]
    assert len(usage) == 1, run.stderr
    assert "cannot send `work -> lock`" in usage[0]
    assert "create `lock` inside `work`" in usage[0] and "Create it inside the taas cell" not in usage[0]


# -- A2: Hugging Face TrainingArguments built in the notebook ----------------------------------
def test_training_arguments_from_the_notebook_describe_the_job(kernel, clean, workdir):
    setup = kernel.run(tiny_bert_notebook(str(workdir / "hf-out"), use_cpu=True)
                       + 'print("kernel", args.world_size)')
    assert setup.error is None, setup.traceback
    assert setup.stdout.strip() == "kernel 1"
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        trainer = Trainer(model, args, train_dataset=ds)
        batches = len(trainer.get_train_dataloader())
        trainer.train()
        print("args.world_size", args.world_size, "process", args.process_index,
              "should_save", args.should_save, "batches", batches)
        model = trainer.model
        """))
    assert run.error is None, run.traceback
    assert "[rank0] args.world_size 2 process 0 should_save True batches 4" in run.stdout, run.stdout
    assert "[rank1] args.world_size 2 process 1 should_save False batches 4" in run.stdout, run.stdout
    assert "never communicated" not in run.stderr
    back = kernel.run("print(type(model).__name__, args.world_size)")
    assert back.stdout.strip() == "BertForSequenceClassification 1", back.traceback


def test_accelerate_test_script_with_ranks_sharing_one_file(kernel, clean, workdir):
    """accelerate's own test_script appends to one file from every rank and reads it back on
    the main process: ranks coordinating through a file need ``--storage shared`` (with the
    default layer each rank > 0 writes its own copy, merged after the job)."""
    run = kernel.run(cell("""
        %%taas --gpus 2 --storage shared
        from accelerate import Accelerator
        from accelerate.test_utils.scripts.test_script import process_execution_check
        process_execution_check()
        state = Accelerator().state
        print("distributed", state.distributed_type, "processes", state.num_processes)
        """))
    assert run.error is None, run.traceback
    assert "[rank1] distributed DistributedType.MULTI_CPU processes 2" in per_rank(run.stdout), per_rank(run.stdout)
    assert not (workdir / "check_main_process_first.txt").exists()


def test_trainer_without_use_cpu_also_runs_as_the_job_on_cpu(kernel, clean, workdir):
    kernel.run(f"from transformers import TrainingArguments\n"
               f"plain_args = TrainingArguments(output_dir={str(workdir / 'hf-plain')!r}, report_to=[])")
    run = kernel.run("%%taas --gpus 2\n"
                     "print('world', plain_args.world_size, plain_args.device, plain_args.process_index)")
    assert run.error is None, run.traceback
    assert re.search(r"\[rank1\] world 2 cpu(:0)? 1", run.stdout), run.stdout


# -- A5: results through wrappers --------------------------------------------------------------
def test_ddp_inside_any_result_and_fabric_wrappers_come_back_as_plain_modules(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from lightning_fabric import Fabric
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = fabric.setup(model, opt)
        for _ in range(3):
            loss = model(torch.ones(8, 4)).pow(2).mean()
            fabric.backward(loss)
            opt.step(); opt.zero_grad()
        class Box:
            pass
        box = Box()
        box.net = DDP(torch.nn.Linear(2, 2))
        nested = {"ddp": DDP(torch.nn.Linear(2, 2)), "list": [DDP(torch.nn.Linear(2, 2))], "tuple": (box.net,)}
        trained = round(model.weight.sum().item(), 6)
        """))
    assert run.error is None, run.traceback
    assert "was not brought back" not in run.stderr, run.stderr
    check = kernel.run(cell("""
        print(type(model).__name__, round(model.weight.sum().item(), 6) == trained, trained != 0)
        print(type(opt).__name__, type(nested["ddp"]).__name__, type(nested["list"][0]).__name__,
              type(box.net).__name__, type(nested["tuple"][0]).__name__)
        """))
    assert check.error is None, check.traceback
    assert check.stdout.splitlines() == ["Linear True True", "SGD Linear Linear Linear Linear"], check.stdout


# -- A6: ranks that never communicate ----------------------------------------------------------
ALONE = "the 2 ranks never communicated"


def test_ranks_that_never_communicate_are_told(kernel, clean):
    # Ranks that train (backward passes, optimizer steps) but never make a collective.
    run = kernel.run("%%taas --gpus 2\nimport torch\nmodel = torch.nn.Linear(2, 1)\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                     "model(torch.ones(3, 2)).sum().backward(); opt.step()\nprint('alone')")
    assert run.error is None, run.traceback
    assert run.stderr.count(ALONE) == 1, run.stderr


@pytest.mark.parametrize("body", [
    "dist.all_reduce(torch.ones(1))",
    "dist.barrier()",
    "m = DDP(torch.nn.Linear(2, 1)); m(torch.ones(2, 2)).sum().backward(); del m",
    "g = dist.new_group([0, 1]); dist.all_reduce(torch.ones(1), group=g)",
    "dist.all_reduce(torch.ones(1)); dist.destroy_process_group()",
    "t = torch.ones(1)\nif dist.get_rank() == 0:\n    dist.send(t, 1)\nelse:\n    dist.recv(t, 0)",
])
def test_ranks_that_communicate_are_not_told(kernel, clean, body):
    run = kernel.run("%%taas --gpus 2\nimport torch, torch.distributed as dist\n"
                     "from torch.nn.parallel import DistributedDataParallel as DDP\n" + body)
    assert run.error is None, run.traceback
    assert "never communicated" not in run.stderr, run.stderr


def test_one_rank_is_never_told(kernel, clean):
    run = kernel.run("%%taas --gpus 1\nprint('one')")
    assert run.error is None and "never communicated" not in run.stderr, run.stderr


# -- D5: results that cannot come back cost only themselves ------------------------------------
def test_a_value_that_cannot_come_back_never_loses_the_job_or_the_others(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        deep = []
        for _ in range(5000):
            deep = [deep]
        too_deep = []
        for _ in range(100000):
            too_deep = [too_deep]
        class Leaves:
            def __reduce__(self):
                raise SystemExit(3)
        leaves = Leaves()
        kept = 42
        dist.barrier()
        kept + 1
        """))
    assert run.error is None, run.traceback
    assert "`too_deep` was not brought back: list is nested too deeply" in run.stderr, run.stderr
    assert "`leaves` was not brought back: Leaves cannot be pickled (SystemExit: 3)" in run.stderr
    assert run.result == "43"
    check = kernel.run("d, n = deep, 0\nwhile d:\n    d, n = d[0], n + 1\nprint(kept, n)")
    assert check.stdout.strip() == "42 5000", check.traceback


def test_a_result_that_fails_to_unpickle_in_the_kernel_costs_only_itself(kernel, clean):
    kernel.run(cell("""
        import os
        class KernelRefuses:
            def __init__(self):
                self.state = 1
            def __setstate__(self, state):
                if "RANK" not in os.environ:
                    raise SystemExit("not here")
        """))
    run = kernel.run("%%taas --gpus 2\nrefused = KernelRefuses()\nkept2 = 7\n"
                     "import torch.distributed as d\nd.barrier()")
    assert run.error is None, run.traceback
    assert "`refused` was not brought back: SystemExit: not here" in run.stderr, run.stderr
    assert kernel.run("print(kept2)").stdout.strip() == "7"


# -- D11: a rank that leaves early is named, and the job does not hang -------------------------
@pytest.mark.parametrize("leave, expected", [
    ("sys.exit(0)", "rank1 exited with code 0 (sys.exit) while the other ranks were still running"),
    ("os._exit(0)", "rank1 exited (code 0) while the other ranks were still running"),
    ("pass  # rank 1 skips the collective and finishes the cell",
     "rank1 exited (code 0) while the other ranks were still running"),
])
def test_a_rank_that_leaves_early_is_named_and_nothing_hangs(kernel, clean, leave, expected):
    body = cell(f"""
        %%taas --gpus 2 --timeout 60
        import os, sys, torch, torch.distributed as dist
        if dist.get_rank() == 1:
            {leave}
        else:
            dist.all_reduce(torch.ones(1))
        """)
    run = kernel.run(body)
    assert run.status == "error"
    tb = plain(run.traceback)
    assert expected in tb, tb
    assert "--timeout" not in tb and "rank0: stopped after rank1 exited" in tb, tb


# -- IPython syntax in a taas cell, and every name rank 0 binds (issue 23) ------------------------
SCRIPT = """\
import sys
import torch.distributed as dist
print("script", __name__, sys.argv[1:], "rank", dist.get_rank())
steps = int(sys.argv[1].split("=")[1])
class Run:
    pass
run = Run()
run.steps = steps
dist.destroy_process_group()  # as nanoGPT's train.py ends
"""


def test_run_bang_and_names_bound_any_way_come_back(kernel, clean, workdir):
    (workdir / "tiny_script.py").write_text(SCRIPT)
    (workdir / "broken_script.py").write_text("x = 1\nraise ValueError('from the script')\n")
    kernel.run("tag = 'v1'\nread_only = [1, 2]")
    run = kernel.run(cell("""
        %%taas --gpus 2
        %run tiny_script.py --steps=3 --tag={tag}
        files = !ls *_script.py
        !echo shell says $RANK in $PWD
        exec("by_exec = steps * 2")
        globals()["by_globals"] = len(read_only)
        from os.path import *
        exec("import torch; big = torch.ones(1 << 19)")  # 2 MiB: out of rank 0's memory, no pickle
        %time doubled = steps * 2
        """))
    assert run.error is None, run.traceback
    status = kernel.run("%taas").stdout
    assert "big results: 1 storage, 0.00 GiB" in status, status
    assert kernel.run("print(big.sum().item() == 1 << 19)").stdout.strip() == "True"
    out = per_rank(run.stdout)
    for rank in (0, 1):
        assert f"[rank{rank}] script __main__ ['--steps=3', '--tag=v1'] rank {rank}" in out, out
        assert f"[rank{rank}] shell says {rank} in {workdir}" in out, out
        assert f"[rank{rank}] Wall time: " in out, out
    names = kernel.run("print(doubled, steps, run.steps, type(run).__name__, files, by_exec, by_globals, "
                       "join('a', 'b'), type(files).__name__, tag, read_only)")
    assert names.stdout.strip() == ("6 3 3 Run ['broken_script.py', 'tiny_script.py'] 6 2 a/b SList "
                                    "v1 [1, 2]"), names.stdout + names.stderr
    failed = kernel.run("%%taas --gpus 2\n\n%run broken_script.py")
    tb = plain(failed.traceback)
    assert "line 3" in tb and "%run broken_script.py" in tb, tb  # the cell's line, as typed
    assert "broken_script.py" in tb and "raise ValueError('from the script')" in tb, tb


def test_a_magic_with_no_meaning_in_a_rank_is_one_line_before_anything_starts(kernel):
    for body, named in (("x = 1\n%matplotlib inline", "%matplotlib (line 3)"), ("%%bash\nls", "%%bash (line 2)")):
        run = kernel.run(f"%%taas --gpus 2\n{body}")
        assert one_line_usage_error(run).startswith(f"UsageError: {named}"), run.stderr
