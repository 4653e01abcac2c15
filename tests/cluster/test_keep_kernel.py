"""--keep on the simulated cluster, through a real kernel (issue 16, "On a cluster"): the ranks
stay up under the node agents between cells, on both GPU nodes, their GPUs reserved; the next
cell of the same world runs on them; release, another world, the idle limit, leaving the
cluster and unloading taas end them; a failed cell and an interrupt keep the state; a lost rank
or a killed kernel leaves nothing behind.

One kernel for the module (connected_module_kernel); every test ends its kept ranks, so the
next finds no rank running."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.support.cluster_helpers import connected_module_kernel  # noqa: F401 (the module's kernel fixture)
from tests.support.cluster_helpers import (agents, connected_kernel, job_processes,
                                          placement_groups_left)
from tests.support.kernel_driver import (cell, cmdline, is_alive, plain, shm_entries, unmapped_shm,
                                         wait_for, wait_until_gone)
from tests.support.kept import ok, typo_and_interrupt_keep_the_state
from tests.support.ranks import per_rank

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

WHERE = """
import os
print("where", os.environ["RANK"], os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"], os.getpid(),
      state, flush=True)
"""


def _ranks(ray_cluster) -> list[int]:
    return sorted(p.pid for p in job_processes(ray_cluster))


def _where(run) -> dict[int, tuple]:
    """rank -> (GROUP_RANK, LOCAL_RANK, pid, state) as each rank printed it (WHERE)."""
    return {int(r): (int(g), int(lr), int(pid), int(s))
            for r, g, lr, pid, s in re.findall(r"where (\d) (\d) (\d) (\d+) (\d+)", run.stdout)}


def _released(ray_cluster, pids, timeout=10.0) -> None:
    assert wait_until_gone(pids, timeout=timeout) == [], [cmdline(p) for p in job_processes(ray_cluster)]
    assert placement_groups_left(ray_cluster) == "0"


def test_kept_ranks_keep_their_namespace_on_both_nodes_and_are_shown_and_released(kernel, ray_cluster):
    first = ok(kernel.run(cell("""
        %%taas --gpus 4 --keep
        import torch, torch.distributed as dist
        state = 40 + dist.get_rank()
        """) + WHERE))
    before = _where(first)
    assert sorted(before) == [0, 1, 2, 3], first.stdout
    pids = _ranks(ray_cluster)
    assert len(pids) == 4
    # No --gpus: the same world, on the same processes, in the same namespaces, on both nodes.
    second = ok(kernel.run(cell("""
        %%taas
        state += 1
        t = torch.ones(1)
        dist.all_reduce(t)
        total = t.item()
        """) + WHERE))
    after = _where(second)
    assert {r: (g, lr, pid, s - 1) for r, (g, lr, pid, s) in after.items()} == before, (before, after)
    assert [after[r][:2] for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)], after
    assert ok(kernel.run("print(state, total)")).stdout.split() == ["41", "4.0"]  # rank 0's names
    assert _ranks(ray_cluster) == pids
    status = ok(kernel.run("%taas")).stdout
    assert "kept ranks: 4 on cpu/gloo on the cluster, 2 cell(s)" in status, status
    assert "GPUs reserved on the cluster: 2 on 127.0.1.1, 2 on 127.0.1.2" in status, status
    assert "rank3" in status and "MiB" in status, status
    held = placement_groups_left(ray_cluster, wait=0)  # its stdout, then Ray's stderr
    assert held.splitlines()[0] == "1", held  # the GPUs stay reserved between cells
    released = ok(kernel.run("%taas release"))
    assert "released the kept ranks (4 on cpu/gloo)" in released.stdout
    _released(ray_cluster, pids, timeout=5)
    assert "kept ranks" not in ok(kernel.run("%taas")).stdout


def test_another_world_fresh_and_the_idle_limit_end_the_kept_ranks(kernel, ray_cluster):
    ok(kernel.run("%%taas --gpus 4 --keep\nx = 1"))
    pids = _ranks(ray_cluster)
    run = ok(kernel.run("%%taas --gpus 2\nimport os\nos.environ['WORLD_SIZE']"))
    assert run.result == "'2'"
    lines = [line for line in run.stderr.splitlines() if "released the kept ranks" in line]
    assert len(lines) == 1 and "asks for 2 rank(s)" in lines[0], run.stderr
    assert wait_until_gone(pids, timeout=10) == []
    ok(kernel.run("%%taas --gpus 4 --keep\nx = 1"))
    pids = _ranks(ray_cluster)
    run = ok(kernel.run("%%taas --gpus 4 --fresh --keep 2s\n'x' in dir()"))
    assert run.result == "False"  # fresh ranks: the kept namespace is gone
    assert "released the kept ranks (4 on cpu/gloo): --fresh" in run.stderr
    assert wait_until_gone(pids, timeout=10) == []
    pids = _ranks(ray_cluster)
    _released(ray_cluster, pids, timeout=15)  # the idle limit (2 s) ends them without a cell
    run = ok(kernel.run("%%taas --gpus 4\n'x' in dir()"))
    assert run.result == "False"
    assert "were released after 2 s idle (--keep 2s)" in run.stderr, run.stderr


def test_a_failed_cell_and_an_interrupt_keep_the_state(kernel, ray_cluster):
    pids = typo_and_interrupt_keep_the_state(kernel, 4, lambda: _ranks(ray_cluster), named="rank3")
    ok(kernel.run("%taas release"))
    _released(ray_cluster, pids)


def test_back_to_back_kept_cells_each_run_whole_on_the_same_ranks(kernel, ray_cluster):
    ok(kernel.run("%%taas --gpus 4 --keep\nimport os, torch, torch.distributed as dist\npid = os.getpid()"))
    pids = _ranks(ray_cluster)
    cells = [cell(f"""
        %%taas
        t = torch.tensor([float(dist.get_rank() + {i})])
        dist.all_reduce(t)
        total{i} = t.item()
        same{i} = os.getpid() == pid
        """) for i in range(3)]
    sent = [kernel.execute(code) for code in cells]  # all queued at once, as Run All does
    replies = [kernel.reply(msg_id)["content"] for msg_id in sent]
    assert [r["status"] for r in replies] == ["ok"] * 3, [(r.get("ename"), r.get("evalue")) for r in replies]
    seen = kernel.run("print(total0, total1, total2, same0, same1, same2)")
    assert seen.stdout.split() == ["6.0", "10.0", "14.0", "True", "True", "True"], seen.stdout
    assert _ranks(ray_cluster) == pids
    ok(kernel.run("%taas release"))
    _released(ray_cluster, pids)


def test_a_lost_rank_ends_the_kept_ranks_in_one_line(kernel, ray_cluster):
    ok(kernel.run("%%taas --gpus 4 --keep\nimport os, signal\nkept = 1"))
    pids = _ranks(ray_cluster)
    run = kernel.run(cell("""
        %%taas
        import torch.distributed as dist
        if dist.get_rank() == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        """))
    ended = time.monotonic()
    assert run.error is not None and run.error["ename"] == "JobFailed"
    lost = [line for line in run.stderr.splitlines() if "state is" in line and "lost" in line]
    assert len(lost) == 1, run.stderr
    assert "rank3 was killed by SIGKILL" in plain(run.traceback), plain(run.traceback)
    assert wait_until_gone(pids, timeout=max(0.1, 5 - (time.monotonic() - ended))) == []
    assert ok(kernel.run("%%taas --gpus 4\n'kept' in dir()")).result == "False"  # fresh ranks

    # A rank killed between cells: the next cell says so in one line and starts fresh ranks.
    ok(kernel.run("%%taas --gpus 4 --keep\nkept = 1"))
    pids = _ranks(ray_cluster)
    os.kill(pids[-1], signal.SIGKILL)
    wait_for(lambda: not is_alive(pids[-1]), timeout=10, what="the rank gone")
    run = ok(kernel.run("%%taas --gpus 4\n'kept' in dir()"))
    assert run.result == "False"
    lines = [line for line in run.stderr.splitlines() if "released the kept ranks" in line]
    assert len(lines) == 1 and "state is lost" in lines[0], run.stderr
    _released(ray_cluster, pids)


def test_leaving_the_cluster_and_unloading_taas_end_the_kept_ranks(kernel, ray_cluster):
    ok(kernel.run("%%taas --gpus 4 --keep\nx = 1"))
    pids = _ranks(ray_cluster)
    local = ok(kernel.run("%taas cluster local"))
    assert "released the kept ranks (4 on cpu/gloo)" in local.stdout, local.stdout
    _released(ray_cluster, pids)
    ok(kernel.run(f"%taas cluster {ray_cluster.address}"))
    ok(kernel.run("%%taas --gpus 4 --keep\nx = 1"))
    pids = _ranks(ray_cluster)
    ok(kernel.run("%unload_ext taas"))
    _released(ray_cluster, pids)
    ok(kernel.run("%load_ext taas"))
    ok(kernel.run(f"%taas cluster {ray_cluster.address}"))  # as the module's fixture left it


def test_a_killed_kernel_leaves_nothing_of_its_kept_ranks(ray_cluster, tmp_path):
    others = set(agents(ray_cluster))  # the module kernel's agents stay
    shm = shm_entries()
    k = connected_kernel(ray_cluster, tmp_path)
    try:
        ok(k.run("import torch\nbig = torch.ones(4 << 20)"))  # 16 MiB: travels as a shared file
        ok(k.run("%%taas --gpus 4 --keep\nx = float(big.sum())\nprint('up', flush=True)"))
        ranks = _ranks(ray_cluster)
        mine = [pid for pid in agents(ray_cluster) if pid not in others]
        assert len(ranks) == 4 and mine
        kernel_pid = k.descendants()[0].pid  # nsenter's child: the kernel itself
        os.kill(kernel_pid, signal.SIGKILL)
        assert wait_until_gone(ranks, timeout=5) == [], [cmdline(p) for p in job_processes(ray_cluster)]
        assert wait_until_gone(mine, timeout=120) == []
        assert placement_groups_left(ray_cluster) == "0"
        # Other kernels on this machine may hold segments of their own: only unmapped ones leaked.
        assert unmapped_shm({n for n in shm_entries() - shm if n.startswith("taas-")}, wait=5) == set()
    finally:
        k.shutdown()


def test_rank_zeros_files_reach_the_notebook_after_each_kept_cell_on_copy_nodes(kernel, ray_cluster):
    """Nodes with a copy of the working directory: what rank 0 writes is in the notebook's
    directory when each kept cell ends, and what the notebook writes between kept cells reaches
    the copies before the next."""
    ok(kernel.run(f"%taas cluster {ray_cluster.address} --workdir copy"))
    try:
        ok(kernel.run(cell("""
            %%taas --gpus 4 --keep
            import os, torch.distributed as dist
            if dist.get_rank() == 0:
                with open("kept-one.txt", "w") as f:
                    f.write(os.getcwd())
            """)))
        pids = _ranks(ray_cluster)
        where = (kernel.workdir / "kept-one.txt").read_text()
        assert where != str(kernel.workdir)  # rank 0 ran in its node's copy
        ok(kernel.run("with open('from-notebook.txt', 'w') as f:\n    f.write('hello')"))
        run = ok(kernel.run(cell("""
            %%taas
            print("read", open("from-notebook.txt").read(), flush=True)
            if dist.get_rank() == 0:
                with open("kept-two.txt", "w") as f:
                    f.write("two")
            """)))
        assert per_rank(run.stdout).count("read hello") == 4, run.stdout
        assert (kernel.workdir / "kept-two.txt").read_text() == "two"
        assert _ranks(ray_cluster) == pids
        ok(kernel.run("%taas release"))
        _released(ray_cluster, pids)
    finally:
        kernel.run(f"%taas cluster {ray_cluster.address} --workdir auto")  # as the fixture left it
