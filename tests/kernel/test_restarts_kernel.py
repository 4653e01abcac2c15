"""--max-restarts through a real kernel: a failed job starts again with TORCHELASTIC_RESTART_COUNT
one higher, one line per restart names the root cause, checkpoints carry over, a loop that fails
every time stops after R restarts, registered loaders deliver every unit once per attempt, and an
interrupt or a killed kernel during the restarts leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.support.kernel_driver import (Kernel, OFFLINE, cell, one_line_usage_error, plain, process_name, wait_for,
                                         wait_until_gone)
from tests.support.launchers import on_both_launchers
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


KERNEL_ENV = OFFLINE  # the module's kernel (tests/conftest.py) runs offline


@on_both_launchers
def test_a_failed_attempt_restarts_and_reads_rank_zeros_checkpoint(kernel, clean, workdir):
    run = kernel.run(cell("""
        %%taas --gpus 2 --max-restarts 2
        import os, torch, torch.distributed as dist
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        step = torch.load("ckpt.pt")["step"] if os.path.exists("ckpt.pt") else 0
        print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']} resumes at step {step}")
        t = torch.ones(1)
        for step in range(step, 6):
            dist.all_reduce(t)
            if dist.get_rank() == 0:
                torch.save({"step": step + 1}, "ckpt.pt")
            dist.barrier()
            if attempt == 0 and step == 2 and dist.get_rank() == 1:
                raise RuntimeError("lost rank 1 at step 2")
        final = (attempt, step + 1)
        """))
    assert run.error is None, run.traceback
    err = plain(run.stderr)
    assert err.count("taas: restart ") == 1, err
    assert "taas: restart 1/2: rank1 failed: RuntimeError: lost rank 1 at step 2" in err
    assert "[rank0] attempt 0 of 2 resumes at step 0" in per_rank(run.stdout)
    assert "[rank0] attempt 1 of 2 resumes at step 3" in per_rank(run.stdout)
    assert "[rank1] attempt 1 of 2 resumes at step 3" in per_rank(run.stdout)
    assert kernel.run("print(final)").stdout.strip() == "(1, 6)"
    assert "restarts 1" in kernel.run("%taas").stdout
    (workdir / "ckpt.pt").unlink()


def test_a_job_that_always_fails_stops_after_r_restarts_with_the_last_cause(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2 --max-restarts 2
        import os
        if os.environ["RANK"] == "1":
            raise ValueError(f"bad on attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        import torch.distributed as dist
        dist.barrier()
        """))
    assert run.status == "error"
    err = plain(run.stderr)
    assert "taas: restart 1/2: rank1 failed: ValueError: bad on attempt 0" in err
    assert "taas: restart 2/2: rank1 failed: ValueError: bad on attempt 1" in err
    assert "rank1 failed: ValueError: bad on attempt 2 (after 2 restarts)" in plain(run.traceback)


def test_a_timeout_is_not_restarted(kernel, clean):
    run = kernel.run("%%taas --gpus 2 --max-restarts 3 --timeout 3\nimport time\ntime.sleep(600)")
    assert run.status == "error" and "--timeout 3s" in run.traceback
    assert "taas: restart" not in run.stderr


def test_bad_max_restarts_is_a_one_line_usage_error(kernel):
    for value in ("-1", "x"):
        message = one_line_usage_error(kernel.run(f"%%taas --gpus 2 --max-restarts {value}\nprint(1)"))
        assert "--max-restarts must be a whole number from 0 to 100" in message


def test_every_unit_once_per_attempt(kernel, clean):
    """A registered loader delivers each of its units exactly once in every attempt: a
    restarted job reads them again from the start, as a restarted torchrun job re-creates its
    DataLoader."""
    kernel.run(cell("""
        import taas, torch
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4)
        taas.register(loader)
        """))
    run = kernel.run(cell("""
        %%taas --gpus 2 --cpus 2 --max-restarts 1
        import os
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        seen = [int(x) for (batch,) in loader for x in batch]
        print("attempt", attempt, "rank", os.environ["RANK"], "got", len(seen), "sum", sum(seen))
        import torch.distributed as dist
        dist.barrier()  # both read and printed before rank 1 fails: else rank 0 may be stopped mid-read
        if attempt == "0" and os.environ["RANK"] == "1":
            raise RuntimeError("fail after reading")
        """))
    assert run.error is None, run.traceback
    for attempt in (0, 1):
        got = re.findall(rf"attempt {attempt} rank (\d) got (\d+) sum (\d+)", run.stdout)
        assert len(got) == 2, run.stdout
        assert sum(int(n) for _, n, _ in got) == 40 and sum(int(s) for _, _, s in got) == sum(range(40))


def test_interrupt_during_restarts_stops_everything_within_5s(kernel, clean):
    seen = {}

    def on_output(out):
        if "taas: restart 2/" in out.stderr and "at" not in seen:
            seen["at"] = time.monotonic()
            kernel.km.interrupt_kernel()

    run = kernel.run(cell("""
        %%taas --gpus 2 --max-restarts 50
        import os, time
        if os.environ["RANK"] == "1":
            raise RuntimeError("again")
        time.sleep(600)
        """), on_output=on_output)
    assert "at" in seen, run.stderr
    assert run.status == "error" and run.error is not None and run.error["ename"] == "KeyboardInterrupt", \
        (run.error, run.stdout[-3000:], run.stderr[-3000:])
    assert time.monotonic() - seen["at"] < 5
    assert "taas: restart 50/" not in run.stderr


def test_killed_kernel_during_restarts_leaves_nothing(workdir):
    k = Kernel(str(workdir), env=OFFLINE)
    try:
        k.execute(cell("""
            %%taas --gpus 2 --max-restarts 100
            import os, time
            print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
            time.sleep(0.3)
            if os.environ["RANK"] == "1":
                raise RuntimeError("again")
            time.sleep(600)
            """))
        wait_for(lambda: sum(1 for p in k.descendants() if process_name(p).startswith("taas-rank")) >= 2,
                 what="ranks running")
        time.sleep(1.0)  # somewhere in the restart loop: starting, running or stopping
        tree = [p.pid for p in k.descendants()]
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
    finally:
        k.shutdown()


def test_restarts_with_a_registered_loader_succeed_every_time(kernel, clean):
    """The first attempt's clean-up, run late by the start process once its processes ended,
    must never touch the next attempt's shared memory (``taas-<job>-1-…`` starts with
    ``taas-<job>-``): five restarted jobs in a row, every unit delivered once in the attempt
    that succeeded."""
    kernel.run(cell("""
        import taas, torch
        from torch.utils.data import DataLoader, TensorDataset
        unread = DataLoader(TensorDataset(torch.arange(16)), batch_size=4)
        read = DataLoader(TensorDataset(torch.arange(64)), batch_size=4)
        taas.register(unread)
        taas.register(read)
        """))
    body = cell("""
        %%taas --gpus 2 --cpus 1 --max-restarts 1
        import os
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        seen = []
        for (batch,) in read:
            seen.extend(int(x) for x in batch)
            if attempt == "0" and os.environ["RANK"] == "1" and len(seen) >= 8:
                raise RuntimeError("lost rank 1 mid-epoch")
        print("attempt", attempt, "rank", os.environ["RANK"], "units", sorted(seen))
        import torch.distributed as dist
        dist.barrier()
        """)
    for run_index in range(5):
        run = kernel.run(body)
        assert run.error is None, (run_index, run.traceback)
        assert "taas: restart 1/1: rank1 failed: RuntimeError: lost rank 1 mid-epoch" in plain(run.stderr)
        got = re.findall(r"attempt 1 rank (\d) units \[([\d, ]*)\]", run.stdout)
        assert sorted(rank for rank, _ in got) == ["0", "1"], run.stdout
        units = [int(x) for _, listed in got for x in listed.split(",") if x.strip()]
        assert sorted(units) == list(range(64)), (run_index, run.stdout)
    kernel.run("taas.unregister(unread)\ntaas.unregister(read)")
