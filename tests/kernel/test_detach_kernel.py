"""Jobs that outlive the kernel (``--detach``), through real kernels: the cell returns once the
ranks run; a killed kernel leaves the job running; a new kernel attaches, sees the output from
the first line and gets rank 0's names, Out[] and every taas.log row; a failure shows the root
cause with the cell's lines; cancel and a killed host leave nothing; re-running the same cell
attaches instead of starting a copy; an interrupt while attached only detaches.

Jobs wait for a file the test creates (an event), never for time."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from tests.support.kernel_driver import Kernel, cell, shm_entries, unmapped_shm, wait_for, wait_until_gone

pytestmark = pytest.mark.kernel

NOTEBOOK = "work/detach.ipynb"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The module's TAAS_HOME; at its end, every job still running there (a failed test's) is
    cancelled, so that no host or rank outlives the tests."""
    from taas.host import client
    from taas.jobs.store import Store

    path = tmp_path_factory.mktemp("taas-home")
    yield path
    store = Store(path / "jobs")
    for item in store.listing(prune=False):
        if not item.problem and not item.record.state.final:
            client.cancel(store, item.record.id)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("notebook")


def start_kernel(workdir, home) -> Kernel:
    # TAAS_WARM_HOST=1: a job host warm ahead of the first --detach, as users get it.
    return Kernel(str(workdir), env={"TAAS_HOME": str(home), "JPY_SESSION_NAME": NOTEBOOK, "TAAS_WARM_HOST": "1"})


@pytest.fixture(scope="module")
def kernel(workdir, home):
    k = start_kernel(workdir, home)
    yield k
    k.shutdown()


def record(home, job_id: str) -> dict:
    return json.loads((home / "jobs" / job_id / "record.json").read_text())


def job_of(run) -> str:
    assert run.error is None, run.traceback
    line = [x for x in run.stdout.splitlines() if " detached: " in x]
    assert len(line) == 1, run.stdout
    assert "%taas attach" in line[0] and "taas attach" in line[0]
    return line[0].split("job ", 1)[1].split()[0]


def host_tree(home, job_id: str) -> list[psutil.Process]:
    """The job's host and everything under it (guard, start process, ranks)."""
    host = psutil.Process(wait_for(lambda: record(home, job_id)["host_pid"], what="the host's pid"))
    return [host, *host.children(recursive=True)]


def ranks_of(tree) -> list[psutil.Process]:
    return [p for p in tree if p.name().startswith("taas-rank")]


def waiting_cell(go, body: str = "", gpus: int = 2) -> str:
    """A detached cell whose ranks print, then wait for ``go`` to exist, then run ``body``."""
    return cell(f"""
        %%taas --gpus {gpus} --detach
        import os, time, taas
        import torch, torch.distributed as dist
        print("first line", dist.get_rank(), flush=True)
        taas.log(step=0, loss=1.0)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        taas.log(step=1, loss=0.5)
        """) + "\n" + body


def test_a_killed_kernel_leaves_the_job_and_a_new_kernel_gets_its_results(workdir, home, tmp_path):
    go = tmp_path / "go"
    first = start_kernel(workdir, home)
    try:
        assert first.run("import torch\nbase = torch.arange(4.0)\ndef double(x):\n    return 2 * x").error is None
        run = first.run(waiting_cell(go, cell("""
            t = torch.ones(1)
            dist.all_reduce(t)
            doubled = double(base) + t
            print("last line", dist.get_rank())
            int(t.item())
            """)))
        job = job_of(run)
        assert record(home, job)["state"] == "running"  # the cell returned once the ranks ran
        # Both ranks run; a rank forked a moment ago takes its name (taas-rankN) as it starts.
        tree = wait_for(lambda: next((t for t in [host_tree(home, job)] if len(ranks_of(t)) == 2), None),
                        what="both ranks under the host")
        # The kernel's warm process that forks job hosts (taas.host.zygote) is its child.
        zygotes = [p for p in psutil.Process(first.pid).children() if "taas.host.zygote" in " ".join(p.cmdline())]
        assert len(zygotes) == 1
        os.kill(first.pid, signal.SIGKILL)  # nothing of the kernel is needed from now on
        wait_until_gone([first.pid])
        assert wait_until_gone([z.pid for z in zygotes]) == []  # it ends with the kernel
    finally:
        first.shutdown()
    assert all(p.is_running() for p in tree)  # the job goes on
    go.touch()
    second = start_kernel(workdir, home)
    try:
        run = second.run(f"%taas attach {job}")
        assert run.error is None, run.traceback
        out = run.stdout
        assert "[rank0-1] first line" in out or ("[rank0] first line 0" in out and "[rank1] first line 1" in out), out
        assert out.index("first line") < out.index("last line")  # from the first line on
        assert run.result == "2"  # Out[]: the all_reduce over 2 ranks
        check = second.run(f"import taas\nprint(doubled.tolist())\nrows = taas.metrics({job!r})\n"
                           "rows = rows.to_dict('records') if hasattr(rows, 'to_dict') else rows\n"
                           "print(sorted((r['step'], r['rank']) for r in rows))")
        assert check.error is None, check.traceback
        assert check.stdout.splitlines()[0] == "[2.0, 4.0, 6.0, 8.0]"
        assert check.stdout.splitlines()[1] == "[(0, 0), (0, 1), (1, 0), (1, 1)]"  # every row since the start
        again = second.run(f"%taas attach {job}")  # results land once
        assert again.status == "error" and "already taken" in again.stderr, again.stderr
        assert wait_until_gone([p.pid for p in tree]) == []
    finally:
        second.shutdown()


def test_the_failing_rank_traceback_shows_with_the_cell_lines(kernel, home):
    run = kernel.run(cell("""
        %%taas --gpus 2 --detach
        import torch.distributed as dist
        dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("rank one broke")
        dist.barrier()
        """))
    if run.error is None:  # the job may still be running when the cell returns
        job = job_of(run)
        run = kernel.run(f"%taas attach {job}")
    assert run.error is not None
    assert "ValueError" in run.traceback and "rank one broke" in run.traceback
    assert "line 5" in run.traceback and "raise ValueError" in run.traceback  # the cell's own line
    assert "taas/" not in run.traceback.replace("taas/jobs", "")
    listing = kernel.run("%taas jobs").stdout
    assert "failed" in listing and "rank one broke" in listing  # the root cause in one line


def test_cancel_stops_every_process_and_leaves_nothing(kernel, home, tmp_path):
    shm_before = shm_entries()
    job = job_of(kernel.run(waiting_cell(tmp_path / "never")))
    tree = host_tree(home, job)
    run = kernel.run(f"%taas cancel {job}")
    assert run.error is None, run.traceback
    assert run.stdout.strip() == f"taas: job {job} cancelled"
    assert wait_until_gone([p.pid for p in tree]) == []  # within 5 s of the cancel's end
    assert record(home, job)["state"] == "cancelled"
    assert unmapped_shm(shm_entries() - shm_before) == set()
    again = kernel.run(f"%taas cancel {job}")
    assert again.stderr.strip() == f"UsageError: taas: job {job} already ended (cancelled); nothing to cancel"


def test_a_killed_host_ends_its_ranks_and_reads_lost(kernel, home, tmp_path):
    job = job_of(kernel.run(waiting_cell(tmp_path / "never")))
    tree = host_tree(home, job)
    tree[0].send_signal(signal.SIGKILL)
    assert wait_until_gone([p.pid for p in tree]) == []  # no orphan ranks: gone within 5 s
    listing = kernel.run("%taas jobs").stdout
    assert f"{job} lost:" in listing and "ended without a word" in listing, listing
    assert record(home, job)["state"] == "lost"
    run = kernel.run(f"%taas attach {job}")
    assert run.status == "error" and f"job {job} is lost" in run.stderr


def test_running_the_same_cell_again_attaches_and_an_interrupt_only_detaches(kernel, home, tmp_path):
    go = tmp_path / "go"
    code = waiting_cell(go, "print('finished', dist.get_rank())\n")
    job = job_of(kernel.run(code))
    tree = host_tree(home, job)
    # The same cell again: no second job, the cell follows the first one.  Interrupt it once it
    # shows the job's output: the job goes on.
    msg = kernel.execute(code)
    wait_for(lambda: any(p.name() == "taas-rank0" for p in tree), what="the ranks")
    seen = []
    while not any("first line" in text for text in seen):
        message = kernel.kc.get_iopub_msg(timeout=120)
        if message["parent_header"].get("msg_id") == msg and message["msg_type"] == "stream":
            seen.append(message["content"]["text"])
    assert any(f"this cell's job {job} is still running" in text for text in seen), seen
    kernel.km.interrupt_kernel()
    reply = kernel.reply(msg)
    assert reply["content"]["status"] == "ok"
    assert all(p.is_running() for p in tree)
    assert len([p for p in psutil.process_iter(["name"]) if p.info["name"] == "taas-rank0"
                and p.pid in {q.pid for q in tree}]) == 1
    go.touch()
    run = kernel.run(f"%taas attach {job}")
    assert run.error is None, run.traceback
    assert "finished 0" in run.stdout.replace("[rank0-1] finished", "finished 0 finished 1") or \
        "[rank0] finished 0" in run.stdout
    fresh = kernel.run(code.replace("--detach", "--detach --fresh"))
    other = job_of(fresh)
    assert other != job
    kernel.run(f"%taas cancel {other}")


def test_a_registered_loader_restarts_and_a_timeout_hold_in_a_detached_job(kernel, home, workdir):
    # The loader is registered in the notebook, read in the detached cell: its units come from
    # loader workers of the job host's data plane, every unit once per attempt; rank 1 fails on
    # the first attempt, the job starts again (--max-restarts 1) under --timeout; what rank 1
    # writes goes through its storage layer, merged back.
    assert kernel.run(cell("""
        import torch, taas
        from torch.utils.data import DataLoader, TensorDataset
        units = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2)
        taas.register(units)
        """)).error is None
    run = kernel.run(cell("""
        %%taas --gpus 2 --cpus 1 --max-restarts 1 --timeout 300 --detach
        import os
        import torch.distributed as dist
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and dist.get_rank() == 1:
            raise RuntimeError("first attempt fails")
        mine = torch.cat([batch[0] for batch in units])
        total = mine.sum()
        dist.all_reduce(total)
        if dist.get_rank() == 1:
            open("from-rank1.txt", "w").write("rank 1 was here")
        (attempt, float(total))
        """))
    job = job_of(run) if run.error is None else None
    attached = kernel.run(f"%taas attach {job}") if job else run
    assert attached.error is None, attached.traceback + attached.stderr
    assert attached.result == "(1, 120.0)"  # sum(0..15), once, on the second attempt
    assert "first attempt fails" in attached.stderr  # the restart's line names the root cause
    assert (workdir / "from-rank1.txt").read_text() == "rank 1 was here"
    assert kernel.run("taas.unregister(units)").error is None


def test_bad_ids_are_one_line_each(kernel, home):
    for words, expected in (("attach zz", "is not a job id"), ("attach 0123456", "no job '0123456' here"),
                            ("cancel", "takes a job id"), ("forget 01234567", "no job")):
        run = kernel.run(f"%taas {words}")
        assert run.status == "error", run.stdout
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("UsageError: ") and expected in lines[0], run.stderr


def kept_job(kernel, home) -> tuple[str, list[psutil.Process]]:
    """A ``--keep --detach`` job whose ranks hold ``state`` (rank * 10) and rank 0's ``first``."""
    job = job_of(kernel.run(cell("""
        %%taas --gpus 2 --keep --detach
        import torch.distributed as dist
        state = dist.get_rank() * 10
        print("first cell", dist.get_rank(), flush=True)
        first = "from the first cell"
        """)))
    wait_for(lambda: record(home, job)["state"] == "kept", what="the first cell's end")
    return job, host_tree(home, job)


def adopt(kernel, job: str):
    run = kernel.run(f"%taas attach {job}")
    assert run.error is None, run.traceback + run.stderr
    assert f"job {job}'s kept ranks (2 on cpu/gloo) are this notebook's now" in run.stdout, run.stdout
    return run


def test_kept_ranks_outlive_the_kernel_and_a_new_kernel_adopts_them(workdir, home, kernel, tmp_path):
    from taas.host import adopt as adoption
    from taas.host import channel
    from taas.host.api import Hello, Refused
    from taas.jobs.store import JobError, Store

    shm_before = shm_entries()
    first = start_kernel(workdir, home)
    try:
        job, tree = kept_job(first, home)
        os.kill(first.pid, signal.SIGKILL)  # the kernel that started it dies
        wait_until_gone([first.pid])
    finally:
        first.shutdown()
    assert all(p.is_running() for p in tree) and len(ranks_of(tree)) == 2
    second = start_kernel(workdir, home)
    try:
        run = adopt(second, job)  # the first cell's output and names land here
        shown = run.stdout.replace("[rank0-1] first cell", "first cell 0 first cell 1")
        assert "first cell 0" in shown and "first cell 1" in shown, run.stdout
        assert second.run("print(first)").stdout.strip() == "from the first cell"
        # One kernel at a time: another attach says who holds the ranks; a wrong secret is refused.
        with pytest.raises(JobError, match=f"held by kernel pid {second.pid} \\({NOTEBOOK}\\)"):
            adoption.Door(Store(home / "jobs"), job)
        sock = channel.connect(home / "jobs" / job)
        channel.send(sock, Hello("0" * 64, os.getpid()))
        answer, _ = channel.recv(sock)
        assert isinstance(answer, Refused) and "wrong secret" in answer.line
        sock.close()
        run = second.run(cell("""
            %%taas --keep
            print("state", state, flush=True)
            later = state + 1
            """))
        assert run.error is None, run.traceback
        assert "[rank0] state 0" in run.stdout and "[rank1] state 10" in run.stdout, run.stdout
        assert second.run("print(later)").stdout.strip() == "1"  # rank 0's names land here
        status = second.run("%taas").stdout  # they are this notebook's kept ranks, named by their job
        assert f"kept ranks of job {job}: 2 on cpu/gloo on this machine, 2 cell(s)" in status, status
        # An interrupt interrupts the kept cell, not the ranks' life.
        go = tmp_path / "never"
        msg = second.execute(cell(f"""
            %%taas
            import os, time
            print("waiting", flush=True)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.02)
            """))
        while True:
            message = second.kc.get_iopub_msg(timeout=120)
            if message["parent_header"].get("msg_id") == msg and message["msg_type"] == "stream" \
                    and "waiting" in message["content"]["text"]:
                break
        second.km.interrupt_kernel()
        reply = second.reply(msg)
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        assert "the kept ranks and their state stay" in "\n".join(reply["content"]["traceback"])
        os.kill(second.pid, signal.SIGKILL)  # the adopting kernel dies: the ranks wait
        wait_until_gone([second.pid])
    finally:
        second.shutdown()
    assert all(p.is_running() for p in tree)
    adopt(kernel, job)  # adopted again, by the module's kernel
    run = kernel.run("%%taas\nprint('again', state + 2, flush=True)")
    assert run.error is None and "[rank1] again 12" in run.stdout, run.stdout + run.stderr
    run = kernel.run("%taas release")
    assert run.stdout.strip() == f"taas: released the kept ranks (2 on cpu/gloo) of job {job}", run.stdout
    assert wait_until_gone([p.pid for p in tree]) == []  # the host and every rank
    assert record(home, job)["state"] == "done"
    assert not (home / "jobs" / job / "kept.sock").exists() and not (home / "jobs" / job / "secret").exists()
    assert unmapped_shm(shm_entries() - shm_before) == set()


def test_a_killed_host_of_kept_ranks_ends_them_and_reads_lost(kernel, home):
    job, tree = kept_job(kernel, home)
    adopt(kernel, job)
    again = kernel.run(f"%taas attach {job}")
    assert again.stdout.strip() == f"taas: job {job}'s kept ranks are this notebook's already; %taas release ends them"
    tree[0].send_signal(signal.SIGKILL)
    assert wait_until_gone([p.pid for p in tree]) == []  # no orphan ranks: gone within 5 s
    assert kernel.run("%taas jobs").stdout.count(f"{job} lost:") == 1
    run = kernel.run("%%taas --gpus 1\nprint('here')")  # the adopted ranks are gone: said once
    assert run.error is None and "host ended without a word" in run.stderr and "here" in run.stdout, \
        run.stdout + run.stderr


def test_cancel_ends_kept_ranks_and_their_host(kernel, home):
    job, tree = kept_job(kernel, home)
    run = kernel.run(f"%taas cancel {job}")
    assert run.stdout.strip() == f"taas: job {job} cancelled", run.stdout + run.stderr
    assert wait_until_gone([p.pid for p in tree]) == []
    assert not (home / "jobs" / job / "kept.sock").exists()
    run = kernel.run(f"%taas attach {job}")  # the first cell's results still land, once
    assert run.error is None and kernel.run("print(first)").stdout.strip() == "from the first cell"


def test_kept_ranks_end_at_their_idle_limit_and_the_record_says_done(kernel, home):
    job = job_of(kernel.run("%%taas --gpus 2 --keep 2s --detach\nx = 1"))
    tree = host_tree(home, job)
    wait_for(lambda: record(home, job)["state"] == "done", what="the idle limit")
    assert record(home, job)["cause"] == "the kept ranks were released after their idle limit (--keep 2s)"
    assert wait_until_gone([p.pid for p in tree]) == []
    assert not (home / "jobs" / job / "kept.sock").exists()


def test_records_are_private(home):
    jobs = home / "jobs"
    assert os.stat(jobs).st_mode & 0o077 == 0
    for entry in jobs.iterdir():
        assert os.stat(entry).st_mode & 0o077 == 0
        for item in entry.rglob("*"):
            assert os.stat(item).st_mode & 0o077 == 0, item
    assert time.time()  # the walk above reached every file
