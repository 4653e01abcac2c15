"""The launcher's limits through a real kernel: sizes, open files, escaped processes, listening
sockets, two jobs at once, and interrupts at the worst moment."""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time

import psutil
import pytest

from tests.support.kernel_driver import (Kernel, cell, one_line_usage_error, process_name, wait_for, wait_until_gone)

pytestmark = pytest.mark.kernel


# -- 2. sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, says", [
    ("--gpus 100000000000000000000", "1024 ranks at most"),
    ("--gpus 1025", "1024 ranks at most"),
    ("--gpus 1 --cpus 257", "256 loader workers per loader at most"),
])
def test_sizes_beyond_what_taas_runs_are_refused_before_anything_starts(kernel, clean, flags, says):
    before = {p.pid for p in kernel.descendants()}
    run = kernel.run(f"#pragma taas {flags}\nx = 1")
    assert says in one_line_usage_error(run)
    # Nothing of a job started.  (The warm pool %load_ext began may still be filling up on a
    # busy machine: its start process and idle children are no job's.)
    new = [process_name(p) for p in kernel.descendants() if p.pid not in before]
    assert [name for name in new if name not in _WARM_POOL] == []


_WARM_POOL = ("taas-guard", "taas-start", "taas-ready", "python")  # python: not yet renamed


def test_more_processes_than_one_fd_message_holds(kernel, clean):
    # 85 ranks: 255 pipe ends, more than one SCM_RIGHTS message carries (253).
    run = kernel.run("#pragma taas --gpus 85 --show 0\nimport torch.distributed as dist\nn = dist.get_world_size()\nn")
    assert run.error is None, run.traceback
    assert run.result == "85"


def _limited_kernel(workdir, soft: int, hard: int) -> Kernel:
    k = Kernel(str(workdir), load_taas=False)
    resource.prlimit(k.pid, resource.RLIMIT_NOFILE, (soft, hard))
    run = k.run("%load_ext taas")
    assert run.error is None, run.traceback
    return k


def test_job_beyond_the_open_file_limit_is_refused_and_leaks_nothing(workdir):
    k = _limited_kernel(workdir, 200, 200)
    try:
        for _ in range(2):  # warm: the start process, and the fds a finished job closes late
            assert k.run("#pragma taas --gpus 1\nx = 1").error is None
        fds = psutil.Process(k.pid).num_fds()
        run = k.run("#pragma taas --gpus 40\nx = 1")
        evalue = one_line_usage_error(run)
        assert "ulimit -n" in evalue and "use at most" in evalue, evalue
        # The kernel's own (zmq) fds come and go; a leak would stay.
        wait_for(lambda: psutil.Process(k.pid).num_fds() <= fds, timeout=60,
                 what=f"the kernel back to its {fds} open files")
        run = k.run("#pragma taas --gpus 2\nimport torch.distributed as dist\ndist.get_world_size()")
        assert run.error is None, run.traceback
        assert run.result == "2"
    finally:
        k.shutdown()


def test_job_beyond_the_soft_open_file_limit_raises_it_and_runs(workdir):
    k = _limited_kernel(workdir, 100, 4096)
    try:
        run = k.run("#pragma taas --gpus 12 --show 0\nimport torch.distributed as dist\ndist.get_world_size()")
        assert run.error is None, run.traceback
        assert run.result == "12"
    finally:
        k.shutdown()


# -- 3. escapes -------------------------------------------------------------------------------
def test_daemons_started_by_a_rank_end_with_the_job(kernel, clean):
    run = kernel.run(cell("""
        #pragma taas --gpus 1
        import os, subprocess, time
        shell = int(subprocess.check_output(
            ["bash", "-c", "setsid sleep 1000 >/dev/null 2>&1 </dev/null & echo $!"]))
        r, w = os.pipe()
        if os.fork() == 0:  # the classic double fork
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode()); os.close(w)
                time.sleep(1000)
            os._exit(0)
        os.close(w)
        forked = int(os.read(r, 100))
        daemons = [shell, forked]
        """))
    assert run.error is None, run.traceback
    daemons = [int(p) for p in kernel.run("print(*daemons)").stdout.split()]
    assert wait_until_gone(daemons, timeout=5.0) == []


def test_a_daemon_below_an_escaped_process_ends_with_the_job(kernel, workdir, clean):
    # The escaped bash is killed when the job ends; its own child, in yet another session,
    # re-parents to the start process only then, and must not outlive the job either.
    (workdir / "grandchild.pid").unlink(missing_ok=True)
    run = kernel.run(cell("""
        #pragma taas --gpus 1
        import os, subprocess, time
        subprocess.Popen(["setsid", "bash", "-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 & "
                          "echo $! > grandchild.tmp; mv grandchild.tmp grandchild.pid; sleep 1000"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists("grandchild.pid"):
            time.sleep(0.05)
        """))
    assert run.error is None, run.traceback
    grandchild = int((workdir / "grandchild.pid").read_text())
    assert wait_until_gone([grandchild], timeout=5.0) == []


def _job_with_a_daemon(kernel, workdir) -> tuple[str, int]:
    """Start a one-rank job whose rank starts a ``setsid`` daemon (it re-parents to the start
    process at once) and then sleeps: (the cell's msg_id, the daemon's pid)."""
    (workdir / "daemon.pid").unlink(missing_ok=True)
    msg_id = kernel.execute(cell("""
        #pragma taas --gpus 1
        import os, subprocess, time
        pid = subprocess.check_output(
            ["bash", "-c", "setsid sleep 1000 >/dev/null 2>&1 </dev/null & echo $!"]).decode()
        with open("daemon.pid.tmp", "w") as f:
            f.write(pid)
        os.rename("daemon.pid.tmp", "daemon.pid")
        time.sleep(1000)
        """))
    path = workdir / "daemon.pid"
    wait_for(path.exists, what="the rank's daemon")
    return msg_id, int(path.read_text())


def _only(kernel, name: str) -> psutil.Process:
    found = [p for p in kernel.descendants() if process_name(p) == name]
    assert len(found) == 1, found
    return found[0]


def _the_cell_fails_and_the_next_job_runs(kernel, msg_id: str) -> None:
    reply = kernel.reply(msg_id)
    assert reply["content"]["status"] == "error"
    run = kernel.run("#pragma taas --gpus 1\nx = 3\nx")
    assert run.error is None, run.traceback
    assert run.result == "3"


def test_a_daemon_dies_when_the_start_process_is_killed(kernel, workdir, clean):
    msg_id, daemon = _job_with_a_daemon(kernel, workdir)
    starter = _only(kernel, "taas-start")
    below = [p.pid for p in starter.children(recursive=True)]
    starter.kill()  # as the OOM killer would
    assert wait_until_gone([daemon, starter.pid, *below], timeout=5.0) == []
    _the_cell_fails_and_the_next_job_runs(kernel, msg_id)


@pytest.mark.parametrize("how", ["guard", "its process group"])
def test_a_daemon_dies_when_the_guard_is_killed(kernel, workdir, clean, how):
    # The start process's parent-death signal (SIGTERM) ends everything below it; and it leads
    # a process group of its own, so one killpg cannot SIGKILL the guard and it together.
    msg_id, daemon = _job_with_a_daemon(kernel, workdir)
    guard = _only(kernel, "taas-guard")
    starter = _only(kernel, "taas-start")
    below = [p.pid for p in starter.children(recursive=True)]
    if how == "guard":
        os.kill(guard.pid, signal.SIGKILL)
    else:
        os.killpg(os.getpgid(guard.pid), signal.SIGKILL)
    assert wait_until_gone([daemon, starter.pid, *below], timeout=5.0) == []
    _the_cell_fails_and_the_next_job_runs(kernel, msg_id)


@pytest.mark.parametrize("victim", ["kernel", "guard"])
def test_a_kill_while_the_start_process_imports_torch_leaves_nothing(workdir, victim):
    # The guard killed: the start process's parent-death signal, SIGTERM, must end it then too.
    k = Kernel(str(workdir))
    try:
        wait_for(lambda: any(process_name(p) == "taas-start" for p in k.descendants()),
                 what="the start process")
        pids = [p.pid for p in k.descendants()]
        assert len(pids) >= 2  # the guard and the start process, still importing torch
        if victim == "kernel":
            os.kill(k.pid, signal.SIGKILL)
        else:
            guard = [p for p in k.descendants() if p.ppid() == k.pid]
            assert len(guard) == 1
            guard[0].kill()
        assert wait_until_gone(pids, timeout=5.0) == []
    finally:
        try:
            k.shutdown()
        except Exception:
            pass


# -- 4. listeners -----------------------------------------------------------------------------
def _other_addresses() -> list[str]:
    """Addresses of this machine a stranger could use: every non-loopback IPv4 address, and
    127.0.0.2 (loopback, but not the address taas binds)."""
    out = ["127.0.0.2"]
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append(a.address)
    return out


def _refused(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=5):
            return False
    except OSError:
        return True


def test_during_a_job_everything_listens_on_loopback_only(kernel, workdir, clean):
    for name in ("up", "go"):
        (workdir / name).unlink(missing_ok=True)
    result = {}
    # --storage shared: rank 1 polls for a file that appears in the working directory during
    # the job (under the default layer it may keep seeing its own view without it).
    body = cell("""
        #pragma taas --gpus 2 --storage shared
        import os, time, torch.distributed as dist
        if dist.get_rank() == 0:
            open("up", "w").close()
        while not os.path.exists("go"):
            time.sleep(0.05)
        dist.barrier()
        done = True
        """)
    runner = threading.Thread(target=lambda: result.setdefault("run", kernel.run(body)))
    runner.start()
    try:
        wait_for((workdir / "up").exists, what="the job")
        pids = {kernel.pid} | {p.pid for p in kernel.descendants()}
        listening = [c.laddr for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert listening, "the job's store listens somewhere"
        assert {a.ip for a in listening} == {"127.0.0.1"}, listening
        for addr in listening:
            for other in _other_addresses():
                assert _refused(other, addr.port), (other, addr.port)
    finally:
        (workdir / "go").touch()
        runner.join()
    assert result["run"].error is None, result["run"].traceback


# -- 9. two jobs at once ----------------------------------------------------------------------
def test_a_second_job_while_one_runs_is_refused_at_once(kernel, workdir, clean):
    for name in ("bg-up", "bg-go"):
        (workdir / name).unlink(missing_ok=True)
    run = kernel.run(cell("""
        import threading
        def background():
            get_ipython().run_cell_magic("taas", "--gpus 1", (
                "import os, time\\n"
                "open('bg-up', 'w').close()\\n"
                "while not os.path.exists('bg-go'):\\n"
                "    time.sleep(0.05)\\n"
                "bg_done = 7\\n"))
        worker = threading.Thread(target=background)
        worker.start()
        """))
    assert run.error is None, run.traceback
    try:
        wait_for((workdir / "bg-up").exists, what="the background job")
        started = time.monotonic()
        run = kernel.run("#pragma taas --gpus 1\ny = 1")
        assert "already running" in one_line_usage_error(run)
        assert time.monotonic() - started < 10  # at once, not after a 30 s time-out
    finally:
        (workdir / "bg-go").touch()
    run = kernel.run("worker.join(); bg_done")
    assert run.error is None, run.traceback
    assert run.result == "7"
    run = kernel.run("#pragma taas --gpus 1\ny = 2\ny")
    assert run.error is None, run.traceback
    assert run.result == "2"


# -- 10. interrupts ---------------------------------------------------------------------------
_IMPORT_MARKER = cell("""
    import sys
    def _mark_import(event, args, _fired=set()):
        if event == "import" and args[0] == {module!r} and not _fired:
            _fired.add(1)
            open({marker!r}, "w").close()
    sys.addaudithook(_mark_import)
    """)


@pytest.mark.parametrize("module", ["torch._C", "torch.fx", "torch.distributed"])
def test_interrupting_the_first_cell_while_torch_imports_leaves_a_usable_kernel(workdir, module):
    """The interrupt lands while the kernel's first `import torch` is under way: at the moment
    ``module`` starts importing (an audit hook in the kernel tells us)."""
    k = Kernel(str(workdir))
    try:
        marker = workdir / f"importing-{module}"
        marker.unlink(missing_ok=True)
        run = k.run(_IMPORT_MARKER.format(module=module, marker=str(marker)))
        assert run.error is None, run.traceback
        msg_id = k.execute("#pragma taas --gpus 1\nx = 1")
        wait_for(marker.exists, what=f"{module} being imported")
        k.km.interrupt_kernel()
        k.reply(msg_id)
        # After an error the kernel aborts requests that arrive within a short while: those
        # never ran, so send the cell again.
        code = "#pragma taas --gpus 1\nimport torch\ny = int(torch.ones(3).sum())\ny"
        run = wait_for(lambda: (lambda r: r if r.status != "aborted" else None)(k.run(code)),
                       what="the cell running")
        assert run.error is None, run.traceback
        assert run.result == "3"
    finally:
        k.shutdown()
