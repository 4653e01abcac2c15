"""--keep through a real kernel: ranks that live between cells (issue 16, one machine).

Each test ends its kept ranks (``%taas release``) so that ``clean`` finds nothing but the warm
start process.

The tests marked ``on_both_launchers`` also run on the second launcher
(tests/support/private_launcher.py): together they call every kept-ranks method of the launcher
contract on it (next_cell, lost, interrupt, memory and running_pids, reserved, cell_done; fileno
in test_keep_loaders_kernel.py).  The others run on the local launcher only, to keep the suite's
time: what they add is the kernel's side (the Keeper's choices, the watch giving up), and on a
launcher they end in ``stop`` and ``close``, which every kept test ends with too."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.kernel_driver import (INTERRUPT, Replies, cell, is_alive, one_line_usage_error, plain, process_name,
                                         wait_for, wait_until_gone)
from tests.support.kept import ok, typo_and_interrupt_keep_the_state
from tests.support.launchers import kernel_on, on_both_launchers
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


def _rank_pids(kernel) -> list[int]:
    return sorted(p.pid for p in kernel.descendants() if process_name(p).startswith("taas-rank"))


@on_both_launchers
def test_kept_ranks_keep_their_namespace_and_are_shown_and_released(kernel, clean):
    ok(kernel.run(cell("""
        %%taas --gpus 2 --keep
        import os, torch.distributed as dist
        pid = os.getpid()
        state = 40 + dist.get_rank()
    """)))
    pids = _rank_pids(kernel)
    assert len(pids) == 2
    # No --gpus: the same world, on the same processes, in the same namespaces.
    run = ok(kernel.run("%%taas\nstate += 1\nprint('state', state)\nos.getpid() == pid"))
    assert run.result == "True"
    assert "[rank0] state 41" in run.stdout and "[rank1] state 42" in run.stdout
    assert ok(kernel.run("state")).result == "41"  # rank 0's names come back
    # Another cell of the same world, with --keep again: still the same ranks.
    assert ok(kernel.run("#pragma taas --gpus 2 --keep\nos.getpid() == pid")).result == "True"
    assert _rank_pids(kernel) == pids
    status = ok(kernel.run("%taas"))
    assert "kept ranks: 2 on cpu/gloo on this machine" in status.stdout, status.stdout
    assert "idle" in status.stdout and "rank0" in status.stdout and "MiB" in status.stdout
    released = ok(kernel.run("%taas release"))
    assert "released the kept ranks (2 on cpu/gloo)" in released.stdout
    assert wait_until_gone(pids) == []
    assert "kept ranks" not in ok(kernel.run("%taas")).stdout
    assert "no kept ranks" in ok(kernel.run("%taas release")).stdout


# Local launcher only (suite time): the Keeper's choice; the launcher sees stop and close.
def test_another_world_or_fresh_ends_the_kept_ranks_first(kernel, clean):
    ok(kernel.run("%%taas --gpus 2 --keep\nx = 1"))
    pids = _rank_pids(kernel)
    run = ok(kernel.run("%%taas --gpus 1\nimport os\nos.environ['WORLD_SIZE']"))
    assert run.result == "'1'"
    lines = [line for line in run.stderr.splitlines() if "released the kept ranks" in line]
    assert len(lines) == 1 and "asks for 1 rank(s)" in lines[0], run.stderr
    assert wait_until_gone(pids) == []
    ok(kernel.run("%%taas --gpus 2 --keep\nx = 1"))
    pids = _rank_pids(kernel)
    run = ok(kernel.run("%%taas --gpus 2 --fresh --keep\n'x' in dir()"))
    assert run.result == "False"  # fresh ranks: the kept namespace is gone
    assert "released the kept ranks (2 on cpu/gloo): --fresh" in run.stderr
    assert wait_until_gone(pids) == []
    ok(kernel.run("%taas release"))


@on_both_launchers
def test_a_failed_cell_and_an_interrupt_keep_the_state(kernel, clean):
    pids = typo_and_interrupt_keep_the_state(kernel, 2, lambda: _rank_pids(kernel))
    ok(kernel.run("%taas release"))
    assert wait_until_gone(pids) == []


@on_both_launchers
def test_a_rank_that_dies_loses_the_state_in_one_line(kernel, clean):
    ok(kernel.run("%%taas --gpus 2 --keep\nimport os, signal\nkept = 1"))
    pids = _rank_pids(kernel)
    run = kernel.run(cell("""
        %%taas
        import torch.distributed as dist
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    """))
    assert run.error is not None and run.error["ename"] == "JobFailed"
    lost = [line for line in run.stderr.splitlines() if "state is" in line and "lost" in line]
    assert len(lost) == 1, run.stderr
    assert "rank1 was killed by SIGKILL" in plain(run.traceback)
    assert wait_until_gone(pids) == []
    run = ok(kernel.run("%%taas --gpus 2\n'kept' in dir()"))  # fresh ranks
    assert run.result == "False"

    # A rank killed between cells: the next cell says so and starts fresh ranks.
    ok(kernel.run("%%taas --gpus 2 --keep\nkept = 1"))
    pids = _rank_pids(kernel)
    os.kill(pids[-1], signal.SIGKILL)
    wait_for(lambda: not is_alive(pids[-1]), timeout=10, what="the rank gone")
    run = ok(kernel.run("%%taas --gpus 2\n'kept' in dir()"))
    assert run.result == "False"
    lines = [line for line in run.stderr.splitlines() if "released the kept ranks" in line]
    assert len(lines) == 1 and "state is lost" in lines[0], run.stderr
    assert wait_until_gone(pids) == []


# Local launcher only (suite time): the Keeper's timer; the launcher sees stop and close.
def test_idle_limit_releases_the_ranks_and_the_next_cell_says_why(kernel, clean):
    ok(kernel.run("#pragma taas --gpus 2 --keep 2s\nx = 1"))
    pids = _rank_pids(kernel)
    assert len(pids) == 2
    assert wait_until_gone(pids, timeout=15) == []  # without any cell
    run = ok(kernel.run("%%taas --gpus 2\n'x' in dir()"))
    assert run.result == "False"
    lines = [line for line in run.stderr.splitlines() if "were released after" in line]
    assert len(lines) == 1 and "--keep 2s" in lines[0], run.stderr


@on_both_launchers
def test_keep_with_max_restarts_is_a_usage_error(kernel, clean):
    run = kernel.run("%%taas --gpus 2 --keep --max-restarts 1\nx = 1")
    assert "--keep cannot be combined with --max-restarts" in one_line_usage_error(run)


@on_both_launchers
def test_an_unchanged_tensor_is_not_sent_again(kernel, clean):
    ok(kernel.run("import torch\nt = torch.zeros(3)"))
    ok(kernel.run("%%taas --gpus 2 --keep\nfloat(t.sum())"))
    # The ranks change their own copy in place; the notebook's is unchanged, so it is not
    # sent again and the ranks keep theirs.
    ok(kernel.run("%%taas\n_ = t.add_(1)"))
    assert ok(kernel.run("%%taas\nfloat(t.sum())")).result == "3.0"
    # Changed in the notebook (in place): sent again.
    ok(kernel.run("_ = t.add_(5)"))
    assert ok(kernel.run("%%taas\nfloat(t.sum())")).result == "15.0"
    # Rebound in the notebook: sent again.
    ok(kernel.run("t = torch.ones(2)"))
    assert ok(kernel.run("%%taas\nfloat(t.sum())")).result == "2.0"
    ok(kernel.run("%taas release"))


@on_both_launchers
def test_unload_ext_ends_the_kept_ranks(workdir, kernel_launcher):
    k = kernel_on(kernel_launcher, str(workdir))
    try:
        ok(k.run("%%taas --gpus 2 --keep\nx = 1"))
        pids = _rank_pids(k)
        assert len(pids) == 2
        ok(k.run("%unload_ext taas"))
        assert wait_until_gone(pids, timeout=5) == []
    finally:
        k.shutdown()


@on_both_launchers
def test_killed_kernel_leaves_no_kept_rank(workdir, kernel_launcher):
    k = kernel_on(kernel_launcher, str(workdir))
    try:
        ok(k.run("%%taas --gpus 2 --keep\nx = 1"))
        tree = [p.pid for p in k.descendants()]
        assert len(_rank_pids(k)) == 2
        os.kill(k.pid, signal.SIGKILL)
        assert wait_until_gone(tree, timeout=5) == []
    finally:
        k.shutdown()


# Local launcher only (suite time): the watch gives up; the launcher sees stop and close.
def test_a_rank_stuck_in_a_collective_after_a_peer_raised_loses_the_state(kernel, clean):
    ok(kernel.run("%%taas --gpus 2 --keep\nimport torch.distributed as dist\nkept = 1"))
    pids = _rank_pids(kernel)
    started = time.monotonic()
    run = kernel.run(cell("""
        %%taas
        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        dist.barrier()
    """))
    assert time.monotonic() - started < 30
    assert run.error is not None and run.error["ename"] == "JobFailed"
    text = plain(run.traceback)
    assert "rank1 failed: ValueError: rank 1 gives up" in text
    assert "rank0" in text and "dist.barrier()" in text, text  # where rank 0 waited
    lost = [line for line in run.stderr.splitlines() if "state is lost" in line]
    assert len(lost) == 1, run.stderr
    assert wait_until_gone(pids) == []
    assert ok(kernel.run("%%taas --gpus 2\n'kept' in dir()")).result == "False"


# Local launcher only (suite time): interrupt is covered on both by
# test_a_failed_cell_and_an_interrupt_keep_the_state; what follows is stop and close.
def test_an_interrupt_inside_a_collective_loses_the_state_within_seconds(kernel, clean):
    ok(kernel.run("%%taas --gpus 2 --keep\nimport time, torch.distributed as dist\nkept = 1"))
    pids = _rank_pids(kernel)
    seen = {}

    def on_output(out):
        if "[rank1] waiting" in per_rank(out.stdout) and "at" not in seen:
            seen["at"] = time.monotonic()
            kernel.km.interrupt_kernel()

    run = kernel.run(cell("""
        %%taas
        print("waiting", flush=True)
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins: rank 0 waits inside gloo (C code)
        else:
            while True:
                time.sleep(0.1)
    """), on_output=on_output)
    assert "at" in seen
    assert run.error is not None and run.error["ename"] == "KeyboardInterrupt"
    assert "did not all return" in plain(run.traceback)
    assert wait_until_gone(pids, timeout=10) == []
    assert time.monotonic() - seen["at"] < 15
    lost = [line for line in run.stderr.splitlines() if "state is lost" in line]
    assert len(lost) == 1, run.stderr
    assert ok(kernel.run("%%taas --gpus 2\n'kept' in dir()")).result == "False"


@on_both_launchers
def test_many_kept_cells_leave_fds_threads_and_memory_flat(kernel, clean):
    """Kept cells back to back (each reads an unchanged notebook tensor and binds a result):
    after the first few (imports done, caches warm) nothing grows per cell, in the kernel or in
    a rank (benchmarks/keep.py runs 200 and prints the figures)."""
    import psutil

    ok(kernel.run("import torch\nt = torch.ones(1024)"))
    ok(kernel.run("%%taas --gpus 2 --keep\nimport torch.distributed as dist\nn = 0"))

    def fds(p):
        """Open fds but IPython's own history database: its writer thread opens
        history.sqlite-journal for a moment now and then, whatever taas does."""
        count = 0
        for fd in os.listdir(f"/proc/{p.pid}/fd"):
            try:
                count += "history.sqlite" not in os.readlink(f"/proc/{p.pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                pass
        return count

    def figures():
        procs = [psutil.Process(kernel.pid)] + [psutil.Process(p) for p in _rank_pids(kernel)]
        return [(fds(p), p.num_threads(), p.memory_info().rss) for p in procs]

    def kept_cell(i):
        ok(kernel.run(f"%%taas\nx = torch.ones(1)\ndist.all_reduce(x)\nn += 1\ns = float(t.sum()) + {i}"))
        assert ok(kernel.run("s")).result == f"{1024 + i:.1f}"

    try:
        for i in range(5):
            kept_cell(i)
        before = figures()
        for i in range(5, 35):
            kept_cell(i)
        after = figures()
        # The job directory holds the payload and results of the last cell and this one at
        # most, not one of each per cell (the kernel removes a cell's once the next is sent).
        ok(kernel.run("%%taas\nimport os\n"
                      "pickles = [n for n in os.listdir(os.environ['TAAS_JOB_DIR']) if n.endswith('.pkl')]"))
        assert len(ok(kernel.run("pickles")).result.split(",")) <= 3
    finally:
        ok(kernel.run("%taas release"))
    assert len(after) == len(before) == 3
    # Nothing grows (the kernel, shared with earlier tests, may still close one of theirs).
    # A leak per cell would add 30 fds or threads; the kernel's other threads (IPython's history
    # writer, zmq, a plot drawing) hold one or two for a moment now and then.
    for (fds0, threads0, rss0), (fds1, threads1, rss1) in zip(before, after):
        assert fds1 - fds0 < 5 and threads1 - threads0 < 5, (before, after)
        assert rss1 - rss0 < 32 << 20, (before, after)  # 30 cells: no per-cell growth


@on_both_launchers
def test_big_results_of_kept_cells_come_back_by_the_channel_every_cell(kernel, clean):
    """The first kept cell's results channel lives as long as the kept ranks: a big tensor
    rank 0 binds is read out of rank 0's memory (not inside the pickle) in every cell."""
    ok(kernel.run("%%taas --gpus 2 --keep\nimport torch\nback = torch.zeros(4 << 20)"))  # 16 MiB
    for i in range(1, 4):
        ok(kernel.run(f"%%taas\nback = torch.full((4 << 20,), {i}.0)"))
        run = ok(kernel.run("print(float(back[:4].sum()))"))
        assert run.stdout.strip() == f"{4 * i:.1f}", run.stdout
        assert "big results: 1 storage, 0.02 GiB, read from rank 0's memory" in ok(kernel.run("%taas")).stdout
    ok(kernel.run("%taas release"))


@on_both_launchers
def test_kept_cells_feed_taas_metrics_and_the_plot_as_one_cell_jobs_do(kernel, clean):
    """Each kept cell is a job of its own for taas.log: its rows under its own id, drawn in the
    cell, steps counted from 0 again (taas.log without step=)."""
    import ast

    def last_rows():
        run = ok(kernel.run("import taas\nm = taas.metrics()\n"
                             "print(repr(m.to_dict('records') if hasattr(m, 'to_dict') else m))"))
        return ast.literal_eval(run.stdout.strip())

    try:
        for i in range(2):
            flag = " --gpus 2 --keep" if i == 0 else ""
            run = ok(kernel.run(f"%%taas{flag}\nimport taas\nfor k in range(3):\n    taas.log(loss={i}.0 + k)"))
            assert any("image/png" in data for _, data in run.displays), run.displays
            got = last_rows()
            assert sorted((r["rank"], r["step"], r["loss"]) for r in got) == sorted(
                (rank, k, i + k) for rank in (0, 1) for k in range(3)), got
    finally:
        ok(kernel.run("%taas release"))


def test_kept_ranks_bring_back_only_the_names_a_cell_bound(kernel, clean, workdir):
    # Names no assignment shows (exec, %run) come back; on kept ranks a later cell brings back
    # only what it bound: the ranks' older names stay out of the notebook's way.
    (workdir / "kept_script.py").write_text("from_script = [1]\nshared = 'script'\n")
    ok(kernel.run(cell("""
        %%taas --gpus 2 --keep
        exec("early = 1")
        %run kept_script.py
        """)))
    assert ok(kernel.run("print(early, from_script, shared)")).stdout.strip() == "1 [1] script"
    ok(kernel.run("early, from_script, shared = 'notebook', 'notebook', 'notebook'"))
    ok(kernel.run("%%taas\nexec('late = early + 1')\nglobals()['shared'] = 'cell 2'"))
    shown = ok(kernel.run("print(late, early, from_script, shared)")).stdout.strip()
    assert shown == "2 notebook notebook cell 2", shown
    ok(kernel.run("%taas release"))


def test_the_debugger_on_kept_ranks_and_taas_debug_after_a_failed_cell(kernel, clean):
    pdb = "(Pdb) [rank1] "
    run = kernel.run(cell("""
        %%taas --gpus 2 --keep
        import torch.distributed as dist
        secret = 7 * (dist.get_rank() + 1)
        if dist.get_rank() == 1:
            breakpoint()
        dist.barrier()
    """), replies=Replies((pdb, "p secret"), (pdb, "c")))
    ok(run)
    assert "[rank1] 14" in run.before_prompt[1]
    pids = _rank_pids(kernel)
    failed = kernel.run("%%taas\nif dist.get_rank() == 1:\n    hidden = secret + 1\n    raise ValueError('boom')")
    assert failed.status == "error" and "rank1 failed: ValueError: boom" in failed.traceback
    # %taas debug: the root cause's frame (rank 1), its names as they were; leaving keeps them.
    debug = ok(kernel.run("%taas debug", replies=Replies((pdb, "p hidden"), (pdb, "q"))))
    assert "[rank1] -> raise ValueError('boom')" in debug.before_prompt[0]
    assert "[rank1] 15" in debug.before_prompt[1]
    assert one_line_usage_error(kernel.run("%taas debug 5")) == (
        "UsageError: taas: there is no rank 5: the kept ranks are 0-1")
    # q at a breakpoint in a kept cell: the cell fails in one line, the ranks and state stay.
    quit = kernel.run("%%taas\nif dist.get_rank() == 0:\n    breakpoint()\n    x = 1",
                      replies=Replies(("(Pdb) [rank0] ", "q")))
    assert quit.status == "error" and "rank0 left the debugger (q)" in quit.traceback
    # An interrupt at the prompt (rank 0's cell is over, not in a collective, which no
    # interrupt brings back): the cell is interrupted, the ranks stay.
    interrupted = kernel.run("%%taas\nif dist.get_rank() == 1:\n    breakpoint()\n    x = 1",
                             replies=Replies((pdb, INTERRUPT)))
    assert interrupted.status == "error" and interrupted.error["ename"] == "KeyboardInterrupt"
    assert "the kept ranks and their state stay" in interrupted.traceback, interrupted.traceback
    assert ok(kernel.run("%%taas\nsecret")).result == "7"
    assert _rank_pids(kernel) == pids
    ok(kernel.run("%taas release"))
    assert wait_until_gone(pids) == []
