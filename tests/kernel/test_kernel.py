"""End to end through a real Jupyter kernel: what a notebook user does, and what is left after."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from tests.support.kernel_driver import (Kernel, cell, one_line_usage_error, open_files, process_name, wait_for,
                                         wait_until_gone)
from tests.support.launchers import kernel_on, on_both_launchers
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


@on_both_launchers
def test_pragma_cell_runs_ranks_with_notebook_code_and_brings_results_back(kernel, clean):
    setup = kernel.run(cell("""
        import torch, torch.nn as nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 1)
            def forward(self, x):
                return self.fc(x)
        def train(model, steps):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(steps):
                loss = (model(data) - 1).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.item())
            return losses
        data = torch.ones(8, 4)
        """))
    assert setup.error is None, setup.traceback
    run = kernel.run(cell("""
        #!g2.8
        #pragma taas --gpus 2
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(Net())
        losses = train(model, 3)
        print("rank", dist.get_rank(), "of", dist.get_world_size(), "backend", dist.get_backend())
        len(losses) * 10
        """))
    assert run.error is None, run.traceback
    assert "[rank0] rank 0 of 2 backend gloo" in run.stdout
    assert "[rank1] rank 1 of 2 backend gloo" in run.stdout
    assert "no CUDA device" in run.stdout and run.stdout.count("no CUDA device") == 1
    assert run.result == "30"
    check = kernel.run("print(type(model).__name__, isinstance(model, Net), len(losses), losses[-1] < losses[0])")
    assert check.stdout.strip() == "Net True 3 True", check.traceback


@on_both_launchers
def test_magic_form_and_torchrun_environment(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import os
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
        print(",".join(f"{k}={os.environ[k]}" for k in keys[:5]), os.environ["MASTER_ADDR"])
        """))
    assert run.error is None, run.traceback
    assert "[rank1] RANK=1,LOCAL_RANK=1,WORLD_SIZE=2,LOCAL_WORLD_SIZE=2,GROUP_RANK=0 127.0.0.1" in run.stdout


def test_datasphere_cell_calls_init_process_group_itself(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 2
        import os
        import torch
        import torch.distributed as dist
        dist.init_process_group(backend='nccl', init_method='env://')
        rank = int(os.environ['RANK']); world = int(os.environ['WORLD_SIZE'])
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        print(f"rank {rank}/{world}: {t.item()}")
        """))
    assert run.error is None, run.traceback
    assert "[rank0] rank 0/2: 3.0" in run.stdout and "[rank1] rank 1/2: 3.0" in run.stdout


@on_both_launchers
def test_a_failing_rank_shows_its_traceback_with_cell_lines(kernel, clean):
    kernel.run("sentinel = 'before'")
    run = kernel.run(cell("""
        %%taas --gpus 2
        import os
        import torch.distributed as dist
        sentinel = 'after'
        if os.environ['RANK'] == '1':
            raise ValueError('rank one broke')
        dist.barrier()
        """))
    assert run.status == "error"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", run.traceback)
    assert "rank1 failed: ValueError: rank one broke" in tb
    assert re.search(r"Cell In\[\d+\], line 6", tb), tb
    assert "raise ValueError('rank one broke')" in tb
    assert "rank0: stopped after rank1 failed" in tb
    assert "taas/" not in tb  # no taas internals in the user's traceback
    assert kernel.run("print(sentinel)").stdout.strip() == "before"
    again = kernel.run("%%taas --gpus 2\nprint('fine')")
    assert again.error is None and "[rank1] fine" in per_rank(again.stdout)


def test_error_in_a_notebook_function_points_at_its_cell(kernel, clean):
    kernel.run(cell("""
        def helper(x):
            return 1 / x
        """))
    run = kernel.run("%%taas --gpus 2\nhelper(0)")
    tb = re.sub(r"\x1b\[[0-9;]*m", "", run.traceback)
    assert "ZeroDivisionError" in tb and "return 1 / x" in tb and ", in helper" in tb


@on_both_launchers
@pytest.mark.parametrize("body, expected", [
    ("import sys, os\nif os.environ['RANK'] == '1':\n    sys.exit(3)\nimport torch.distributed as d\nd.barrier()",
     "rank1 exited with code 3"),
    ("import os, ctypes\nif os.environ['RANK'] == '1':\n    ctypes.string_at(0)\n"
     "import torch.distributed as d\nd.barrier()",
     "rank1 was killed by SIGSEGV"),
    ("import os, signal\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
     "import torch.distributed as d\nd.barrier()",
     "rank0 was killed by SIGKILL"),
])
def test_exits_and_signals_stop_the_job(kernel, clean, body, expected):
    started = time.monotonic()
    run = kernel.run("%%taas --gpus 2\n" + body)
    assert run.status == "error"
    assert expected in re.sub(r"\x1b\[[0-9;]*m", "", run.traceback)
    assert time.monotonic() - started < 120  # stopped, not left to the 30-minute collective timeout


@on_both_launchers
def test_hang_is_stopped_by_timeout(kernel, clean):
    run = kernel.run("%%taas --gpus 2 --timeout 3\nimport time\nwhile True: time.sleep(0.1)")
    assert run.status == "error" and "--timeout 3s" in run.traceback


@on_both_launchers
def test_only_rank_zero_writes_the_working_directory(kernel, clean, workdir):
    run = kernel.run(cell("""
        %%taas --gpus 2 --storage strict
        import os
        try:
            with open(f"written-by-{os.environ['RANK']}.txt", "w") as f:
                f.write("x")
            print("wrote")
        except OSError as e:
            print("OSError", e.errno)
        with open(os.path.join(os.environ["TAAS_SCRATCH"], "tmp.txt"), "w") as f:
            f.write("scratch ok")
        """))
    assert run.error is None, run.traceback
    assert "[rank0] wrote" in run.stdout
    assert re.search(r"\[rank1\] OSError (30|13)", run.stdout), run.stdout
    assert (workdir / "written-by-0.txt").exists() and not (workdir / "written-by-1.txt").exists()


def test_data_parallel_becomes_ddp(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch, torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel
        m = nn.DataParallel(nn.Linear(2, 2))
        print(isinstance(m, DistributedDataParallel), type(m.module).__name__)
        """))
    assert run.error is None, run.traceback
    assert "[rank0] True Linear" in per_rank(run.stdout) and "[rank1] True Linear" in per_rank(run.stdout)
    assert "DistributedDataParallel" in run.stdout


def test_dataloader_workers_inside_a_rank(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        ds = TensorDataset(torch.arange(16.0))
        total = sum(b[0].sum().item() for b in DataLoader(ds, batch_size=4, num_workers=2))
        print("total", total)
        """))
    assert run.error is None, run.traceback
    assert "[rank1] total 120.0" in per_rank(run.stdout)


@pytest.mark.parametrize("line, message", [
    ("%%taas --gpus 0", "--gpus"),
    ("%%taas --gpus x", "--gpus"),
    ("%%taas --gpus 2 --frobnicate", "--frobnicate"),
    ("x = 1\n#pragma taas --gpus 2", "first line"),
])
def test_bad_directives_are_one_line_usage_errors(kernel, line, message):
    run = kernel.run(line + "\nprint('ran')")
    assert run.status == "error"
    usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError: ")]
    assert len(usage) == 1 and message in usage[0], run.stderr
    assert "ran" not in run.stdout


@pytest.mark.parametrize("setup, name", [
    ("import socket\nsock = socket.socket()", "sock"),
    ("gen = (i for i in range(3))", "gen"),
    ("import socket\nconn = socket.socket()\ndef send():\n    return conn", "send -> conn"),
])
def test_unshippable_values_fail_before_launch(kernel, setup, name):
    kernel.run(setup)
    used = name.split(" -> ")[0]
    run = kernel.run(f"%%taas --gpus 2\nprint('ran')\n{used}")
    assert run.status == "error"
    assert f"UsageError: cannot send `{name}`" in run.stderr, run.stderr
    assert "ran" not in run.stdout


def test_unreferenced_unshippable_values_are_ignored(kernel, clean):
    kernel.run("import threading\nlock_never_used = threading.Lock()")
    run = kernel.run("%%taas --gpus 2\nprint('ok')")
    assert run.error is None and "[rank0] ok" in per_rank(run.stdout)


def test_status_line_magic(kernel):
    run = kernel.run("%taas")
    assert "CUDA" in run.stdout and "last job" in run.stdout


def test_status_and_jobs_line_magics_show_the_machines_gpus_and_their_leases(kernel, tmp_path):
    # Fake GPUs (an NVML list) and a lease held in the kernel itself, as a job's would be.
    setup = kernel.run(cell(f"""
        import os
        os.environ["TAAS_FAKE_GPUS"], os.environ["TAAS_LEASE_DIR"] = "GPU-a,GPU-b", {str(tmp_path / "leases")!r}
        from taas.leases import locks
        from taas.leases.api import Holder
        locks.ensure(os.environ["TAAS_LEASE_DIR"])
        _lease = locks.try_take(os.environ["TAAS_LEASE_DIR"], ["GPU-b"], Holder("ab12cd34ef56", "alice"))
        """))
    try:
        assert setup.error is None, setup.stderr
        for magic in ("%taas", "%taas jobs"):
            run = kernel.run(magic)
            assert "  GPU 0 GPU-a: free\n" in run.stdout, run.stdout + run.stderr
            assert "  GPU 1 GPU-b: leased by job ab12cd34ef56 (alice, since " in run.stdout, run.stdout
    finally:
        kernel.run('_lease.close(); del os.environ["TAAS_FAKE_GPUS"], os.environ["TAAS_LEASE_DIR"]')


def test_cluster_line_magic_selects_this_machine_and_refuses_junk(kernel):
    run = kernel.run("%taas cluster local")
    assert run.error is None and "CUDA" in run.stdout, run.stdout + run.stderr
    assert "%taas cluster takes one address" in one_line_usage_error(kernel.run("%taas cluster a b"))
    assert "cluster ADDRESS|local" in one_line_usage_error(kernel.run("%taas bogus"))
    run = kernel.run("%%taas --cluster local\nprint('here')")
    assert run.error is None and "here" in run.stdout


@on_both_launchers
def test_interrupt_stops_every_rank(kernel, clean):
    seen = {}

    def on_output(out):
        if "[rank1] started" in per_rank(out.stdout) and "at" not in seen:
            seen["at"] = time.monotonic()
            kernel.km.interrupt_kernel()

    run = kernel.run("%%taas --gpus 2\nimport time\nprint('started', flush=True)\nwhile True: time.sleep(0.05)",
                     on_output=on_output)
    assert "at" in seen
    assert run.status == "error" and run.error["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - seen["at"] < 5
    again = kernel.run("%%taas --gpus 2\nprint('next')")
    assert again.error is None and "[rank0] next" in per_rank(again.stdout)


@on_both_launchers
def test_killed_kernel_leaves_no_worker(workdir, kernel_launcher):
    k = kernel_on(kernel_launcher, str(workdir))
    try:
        k.execute("%%taas --gpus 2\nimport time\nprint('up', flush=True)\ntime.sleep(600)")

        def fault_files():  # each rank keeps its faulthandler file open once it runs
            return [f.path for p in k.descendants() if process_name(p).startswith("taas-rank")
                    for f in open_files(p) if f.path.endswith(".fault")]

        wait_for(lambda: len(fault_files()) == 2, what="both ranks running")
        tree = [p.pid for p in k.descendants()]
        assert len(tree) >= 3, tree  # start process (the second launcher: its watcher) + 2 ranks
        job_dirs = {os.path.dirname(path) for path in fault_files()}
        # One job directory; the second launcher gives each process a private root.
        assert len(job_dirs) == (1 if kernel_launcher == "local" else 2)
        assert all(os.path.isdir(d) for d in job_dirs)
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
        assert not any(os.path.exists(d) for d in job_dirs), "the job directory was left behind"
    finally:
        k.shutdown()


def test_kernel_killed_right_after_a_job_leaves_no_job_directory(workdir):
    """A finished job's directory is removed in the background (taas.launch.local.jobdir.discard); a
    kernel killed before that is done leaves nothing either (its guard removes the rest)."""
    import glob
    import tempfile

    k = Kernel(str(workdir))
    try:
        run = k.run("%%taas --gpus 2\nimport os\nfor i in range(200):\n"
                    "    open(os.path.join(os.environ['TAAS_SCRATCH'], str(i)), 'w').close()")
        assert run.error is None, run.traceback
        tree = [p.pid for p in k.descendants()]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"taas-trash-{k.pid}-*")) == []
    finally:
        k.shutdown()


def test_two_kernels_run_jobs_at_the_same_time(workdir):
    a, b = Kernel(str(workdir)), Kernel(str(workdir))
    try:
        body = ("%%taas --gpus 2\nimport torch, torch.distributed as dist, time\nt = torch.ones(1)\n"
                "for _ in range(20):\n    dist.all_reduce(t); time.sleep(0.05)\nprint('sum', t.item())")
        ids = [k.execute(body) for k in (a, b)]
        for k, msg_id in zip((a, b), ids):
            reply = k.reply(msg_id)
            assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        a.shutdown()
        b.shutdown()


def test_unload_removes_magics(workdir):
    k = Kernel(str(workdir))
    try:
        assert k.run("%unload_ext taas").error is None
        run = k.run("%%taas --gpus 2\nprint(1)")
        assert run.status == "error" and "taas" in run.stderr
    finally:
        k.shutdown()


def test_show_filter_hides_other_ranks_until_a_failure(kernel, clean):
    ok = kernel.run("%%taas --gpus 2 --show 0\nimport os\nprint('hello from', os.environ['RANK'])")
    assert ok.error is None, ok.traceback
    assert "[rank0] hello from 0" in ok.stdout and "hello from 1" not in ok.stdout
    bad = kernel.run(cell("""
        %%taas --gpus 2 --show 0
        import os, torch.distributed as dist
        print('rank', os.environ['RANK'], 'was here')
        if os.environ['RANK'] == '1':
            raise RuntimeError('hidden rank failed')
        dist.barrier()
        """))
    assert bad.status == "error"
    assert "[rank1] rank 1 was here" in bad.stdout  # replayed because the job failed


def test_progress_bars_update_in_place(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2 --show 0
        import sys, time
        for i in range(1, 21):
            sys.stderr.write(f"\\rprogress {i}/20")
            sys.stderr.flush()
            time.sleep(0.02)
        sys.stderr.write("\\n")
        print("done")
        """))
    assert run.error is None, run.traceback
    assert "progress" not in run.stderr  # not flooded into the stream
    texts = [data.get("text/plain", "") for _, data in run.displays]
    assert texts and texts[-1] == "[rank0] progress 20/20"
    assert len(texts) < 20  # throttled
    assert "[rank0] done" in run.stdout


def test_rank_zero_display_and_figures_reach_the_notebook(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import matplotlib.pyplot as plt
        display({"rank": 0})
        plt.plot([1, 2, 3])
        plt.show()
        """))
    assert run.error is None, run.traceback
    kinds = [data for kind, data in run.displays if kind == "display_data"]
    assert any("image/png" in d for d in kinds), kinds
    assert sum("'rank': 0" in d.get("text/plain", "") for d in kinds) == 1  # rank 0 only
    assert "[rank1] {'rank': 0}" in run.stdout  # other ranks print it, tagged


def test_values_that_cannot_come_back_are_skipped_with_a_note(kernel, clean):
    run = kernel.run("%%taas --gpus 2\nimport threading\nlock = threading.Lock()\nkept = 41 + 1")
    assert run.error is None, run.traceback
    assert "`lock` was not brought back" in run.stderr
    assert kernel.run("print(kept)").stdout.strip() == "42"


def test_accelerate_runs_as_the_job_ranks(kernel, clean):
    # Plain Accelerator(), as users write it: Accelerator(cpu=True) forces multi-CPU by itself
    # and hid that a CPU job's ranks were each a single-process Accelerator.
    run = kernel.run(cell("""
        %%taas --gpus 2
        import os, torch
        from accelerate import Accelerator
        acc = Accelerator()
        model, opt = acc.prepare(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
        print("accelerate", acc.process_index, "of", acc.num_processes, "rank", os.environ["RANK"],
              acc.distributed_type, type(model).__name__)
        """))
    assert run.error is None, run.traceback
    expected = "[rank0] accelerate 0 of 2 rank 0 DistributedType.MULTI_CPU DistributedDataParallel"
    assert expected in run.stdout, run.stdout
    assert "[rank1] accelerate 1 of 2 rank 1 DistributedType.MULTI_CPU DistributedDataParallel" in run.stdout


def test_syntax_error_points_at_the_cell_line_without_taas_frames(kernel):
    run = kernel.run("%%taas --gpus 2\nx = 1\ny = (2 +\nprint('ran')")
    assert run.status == "error" and run.error["ename"] == "CellSyntaxError"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", run.traceback)
    assert re.search(r"Cell In\[\d+\], line 3", tb), tb
    assert "y = (2 +" in tb and "taas/" not in tb and "interactiveshell" not in tb


def test_sharded_fsdp_objects_are_skipped_with_a_note(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch, torch.nn as nn
        from torch.distributed.fsdp import fully_shard
        m = nn.Linear(4, 4)
        fully_shard(m)
        opt = torch.optim.Adam(m.parameters())
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        """))
    assert run.error is None, run.traceback
    assert "`m` was not brought back" in run.stderr and "`opt` was not brought back" in run.stderr
    assert "DeviceMesh" not in run.stderr


def test_restarted_kernel_leaves_no_worker(workdir):
    k = Kernel(str(workdir))
    try:
        k.execute("%%taas --gpus 2\nimport time\ntime.sleep(600)")
        wait_for(lambda: any(process_name(p) == "taas-rank1" for p in k.descendants()), what="rank 1 running")
        tree = [p.pid for p in k.descendants()]
        assert any(psutil.Process(p).name() == "taas-rank1" for p in tree)
        k.km.restart_kernel(now=True)
        assert wait_until_gone(tree, timeout=5) == []
        k.kc.wait_for_ready(timeout=60)
        k.pid = k.km.provisioner.process.pid
        assert k.run("%load_ext taas").error is None
        again = k.run("%%taas --gpus 2\nprint('after restart')")
        assert again.error is None and "[rank1] after restart" in per_rank(again.stdout)
    finally:
        k.shutdown()


def test_large_display_data_arrives_whole(kernel, clean):
    # 300 kB of HTML: larger than a pipe's buffer, so it reaches the kernel in several reads.
    run = kernel.run("%%taas --gpus 2\nfrom IPython.display import HTML\ndisplay(HTML('<b>' + 'x' * 300000 + '</b>'))")
    assert run.error is None, run.traceback
    html = [d["text/html"] for kind, d in run.displays if "text/html" in d]
    assert html == ["<b>" + "x" * 300000 + "</b>"]


def test_the_harness_says_at_once_when_the_kernel_it_waits_on_died(workdir):
    """A kernel that dies under a cell answers nothing: the test harness fails with that, not
    after the cell's whole timeout (a dead module kernel once held a CI run for many minutes)."""
    k = Kernel(str(workdir))
    try:
        msg_id = k.execute("import time; time.sleep(600)")
        os.kill(k.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="the kernel died"):
            k.reply(msg_id, timeout=120)
        with pytest.raises(RuntimeError, match="the kernel died"):
            k.run("1 + 1", timeout=120)
    finally:
        k.shutdown()


def test_a_cell_past_its_timeout_fails_with_where_the_kernel_was_and_the_kernel_goes_on(workdir):
    """A hang in CI shows where it hung: the harness's timeout carries the kernel's stacks."""
    k = Kernel(str(workdir), load_taas=False)
    try:
        k.run("pass")  # up and running cells: the timeout below is all the cell's (3 s were not, loaded)
        with pytest.raises(TimeoutError) as hung:
            k.run("import time\ndef waiting_in_the_cell():\n    time.sleep(600)\nwaiting_in_the_cell()", timeout=10)
        assert "waiting_in_the_cell" in str(hung.value), str(hung.value)
        assert k.run("print('after')").stdout == "after\n"  # interrupted: the next cell runs
        # pytest-timeout's limit striking while the harness waits (as its SIGALRM would): the
        # failure carries the kernel's stacks too.
        with pytest.raises(pytest.fail.Exception) as struck:
            k.run("import time\ndef waiting_for_ever():\n    print('in', flush=True)\n    time.sleep(600)\n"
                  "waiting_for_ever()", on_output=lambda out: pytest.fail("Timeout >300.0s"))
        assert "waiting_for_ever" in "".join(getattr(struck.value, "__notes__", [])), struck.value
    finally:
        k.shutdown()
