"""The local launcher with real processes: output, exit codes, signals, and nothing left behind."""

import pathlib
import time

import psutil
import pytest

from taas.launch.api import LaunchSpec, OutputChunk, ProcessExit, ProcessSpec
from taas.launch.local import protocol
from taas.launch.local.launcher import LocalLauncher


@pytest.fixture(scope="module")
def launcher():
    launcher = LocalLauncher()
    yield launcher
    pid = launcher.starter_pid
    launcher.shutdown()
    if pid:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def run(launcher, tmp_path, entry, n=2, env=None, timeout=300.0, stop_after=None, args=(), cleanups=()):
    spec = LaunchSpec(
        job_id=f"t{time.monotonic_ns()}",
        cwd=str(tmp_path),
        processes=tuple(
            ProcessSpec(key=f"rank{i}", entry=f"tests.support.launch_targets:{entry}", env=dict(env or {}), args=args)
            for i in range(n)
        ),
        cleanups=cleanups,
    )
    job = launcher.start(spec)
    pids = job.pids
    output: dict[tuple[str, str], bytes] = {}
    exits: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    stopped = False
    while len(exits) < n:
        assert time.monotonic() < deadline, "job did not end"
        if stop_after is not None and not stopped and time.monotonic() - started > stop_after:
            job.stop(grace=0.5)
            stopped = True
        for ev in job.events(0.05):
            if isinstance(ev, OutputChunk):
                output[(ev.key, ev.stream)] = output.get((ev.key, ev.stream), b"") + ev.data
            elif isinstance(ev, ProcessExit):
                exits[ev.key] = ev.returncode
    for ev in job.drain():
        if isinstance(ev, OutputChunk):
            output[(ev.key, ev.stream)] = output.get((ev.key, ev.stream), b"") + ev.data
    job.close()
    return pids, exits, output


def _running(pid: int) -> bool:
    """Alive and not a zombie; one that exits while we look is gone (no NoSuchProcess race)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    assert not alive, f"processes survived: {alive}"


def test_echo_streams_both_outputs(launcher, tmp_path):
    pids, exits, output = run(launcher, tmp_path, "echo")
    assert exits == {"rank0": 0, "rank1": 0}
    for key in ("rank0", "rank1"):
        assert f"hello from {key}".encode() in output[(key, "stdout")]
        assert output[(key, "stderr")] == b"to stderr\n"
    assert_gone(pids.values())


def test_env_cwd_and_own_process_group(launcher, tmp_path):
    pids, exits, output = run(launcher, tmp_path, "env_and_cwd", n=1, env={"TAAS_TEST_VALUE": "42"})
    assert exits == {"rank0": 0}
    assert output[("rank0", "stdout")].decode().split() == ["42", str(tmp_path), "True"]


def test_raise_gives_exit_1_and_traceback_on_stderr(launcher, tmp_path):
    pids, exits, output = run(launcher, tmp_path, "raise_error")
    assert exits == {"rank0": 70, "rank1": 70}
    assert b"ValueError: boom in rank0" in output[("rank0", "stderr")]
    assert_gone(pids.values())


def test_sys_exit_code(launcher, tmp_path):
    pids, exits, _ = run(launcher, tmp_path, "exit_3")
    assert exits == {"rank0": 3, "rank1": 3}


def test_segfault_is_a_signal_exit(launcher, tmp_path):
    pids, exits, _ = run(launcher, tmp_path, "segfault", n=1)
    assert exits == {"rank0": -11}
    assert_gone(pids.values())


def test_ten_megabytes_of_output_do_not_deadlock(launcher, tmp_path):
    pids, exits, output = run(launcher, tmp_path, "big_output", n=2)
    assert exits == {"rank0": 0, "rank1": 0}
    assert len(output[("rank1", "stdout")]) == 10 * 1024 * 1024 + 1


def test_stop_ends_processes_and_their_children(launcher, tmp_path):
    pids, exits, output = run(launcher, tmp_path, "hang_with_child", stop_after=2.0)
    assert set(exits) == {"rank0", "rank1"} and all(code < 0 for code in exits.values())
    children = [int(line.split()[1]) for key in ("rank0", "rank1")
                for line in output.get((key, "stdout"), b"").decode().splitlines() if line.startswith("child")]
    assert children, output
    assert_gone(list(pids.values()) + children)


def test_stop_kills_a_process_that_ignores_sigterm(launcher, tmp_path):
    pids, exits, _ = run(launcher, tmp_path, "ignore_sigterm", n=1, stop_after=1.5)
    assert exits == {"rank0": -9}
    assert_gone(pids.values())


def test_kernel_death_takes_the_start_process_and_jobs_down(tmp_path):
    launcher = LocalLauncher()
    freed = tmp_path / "freed"  # outside the job directory, which the start process removes
    spec = LaunchSpec("dead", str(tmp_path),
                      (ProcessSpec("rank0", "tests.support.launch_targets:hang"),),
                      cleanups=(("tests.support.launch_targets:touch", (str(freed),)),))
    job = launcher.start(spec)
    pids = list(job.pids.values()) + [launcher.starter_pid]
    # What a killed kernel does to the channel: its end closes.
    launcher._conn.close()
    launcher._sock.close()
    assert_gone(pids)
    launcher._proc.wait()
    assert freed.exists()  # the job's cleanup hooks ran before the start process exited


def test_cleanup_hooks_run_when_the_job_is_over(launcher, tmp_path):
    first, last = tmp_path / "first", tmp_path / "last"
    hooks = (("tests.support.launch_targets:touch", (str(first),)), ("tests.support.launch_targets:failing_hook", ()),
             ("no.such.module:hook", ()), ("tests.support.launch_targets:touch", (str(last),)))
    pids, exits, _ = run(launcher, tmp_path, "echo", cleanups=hooks)
    assert exits == {"rank0": 0, "rank1": 0}
    deadline = time.monotonic() + 60
    while not last.exists():  # run after the last exit was reported
        assert time.monotonic() < deadline, "the cleanup hooks did not run"
        time.sleep(0.02)
    assert first.exists()


def test_a_spec_too_big_for_a_ready_child_still_starts(launcher, tmp_path):
    """A loader worker's spec carries its loader's pickle: more than one message to a child
    forked ahead can hold, so the start process forks that one on demand."""
    big = b"x" * (3 << 20)
    pids, exits, output = run(launcher, tmp_path, "args_size", n=2, args=(big,))
    assert exits == {"rank0": 0, "rank1": 0}
    assert output[("rank0", "stdout")] == output[("rank1", "stdout")] == f"{len(big)}\n".encode()
    pids, exits, _ = run(launcher, tmp_path, "echo")  # the start process serves the next job as before
    assert exits == {"rank0": 0, "rank1": 0}


def test_kernel_death_during_a_stop_still_cleans_up(tmp_path):
    """The kernel asks for a stop and dies before the answer: the start process must still
    kill the job and remove its directory (its answer cannot be sent any more)."""
    launcher = LocalLauncher()
    spec = LaunchSpec("dying", str(tmp_path),
                      (ProcessSpec("rank0", "tests.support.launch_targets:ignore_sigterm"),))
    job = launcher.start(spec)
    job_dir = pathlib.Path(job.job_dir)
    assert job_dir.is_dir()
    deadline = time.monotonic() + 30
    while b"ready" not in b"".join(e.data for e in job.events(0.1) if isinstance(e, OutputChunk)):
        assert time.monotonic() < deadline
    pids = list(job.pids.values()) + [launcher.starter_pid]
    protocol.send(launcher._conn, protocol.Stop("dying", 5.0))
    launcher._conn.close()
    launcher._sock.close()
    assert_gone(pids)
    launcher._proc.wait()
    assert not job_dir.exists()


def test_removing_a_job_directory_never_touches_its_parent(tmp_path):
    """A job directory that is already gone (the start process removed it first) must not make
    the clean-up change the permissions of the directory that held it (the system's /tmp)."""
    from taas.launch.local import jobdir

    parent = tmp_path / "tmp"
    parent.mkdir(mode=0o777)
    parent.chmod(0o1777)
    jobdir.remove(str(parent / "taas-gone"))
    assert parent.stat().st_mode & 0o7777 == 0o1777
    locked = parent / "taas-locked"
    (locked / "work" / "inner").mkdir(parents=True)
    (locked / "work" / "inner" / "f").write_text("x")
    (locked / "work").chmod(0)
    jobdir.remove(str(locked))
    assert not locked.exists() and parent.stat().st_mode & 0o7777 == 0o1777


_OWNER = """
import json, sys, time
from taas.launch.api import LaunchSpec, ProcessSpec
from taas.launch.local.launcher import LocalLauncher
launcher = LocalLauncher()
job = launcher.start(LaunchSpec("owned", sys.argv[1], (ProcessSpec("rank0", "tests.support.launch_targets:hang"),)))
print(json.dumps({"dir": job.job_dir, "starter": launcher.starter_pid, "ranks": list(job.pids.values())}), flush=True)
time.sleep(600)
"""


def test_an_owner_and_its_start_process_killed_mid_shutdown_leave_no_job_directory(tmp_path):
    """The kernel dies (SIGKILL) and its start process cannot finish removing its jobs' files
    (here: it is stopped, so the guard must SIGKILL it past its deadline): the guard removes the
    job directory, whose name carries the kernel's pid."""
    import json
    import os
    import signal
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], stdout=subprocess.PIPE,
                             cwd=str(pathlib.Path(__file__).parents[4]))
    try:
        started = json.loads(owner.stdout.readline())
        job_dir = pathlib.Path(started["dir"])
        assert job_dir.is_dir() and job_dir.name.startswith(f"taas-job-{owner.pid}-owned-")
        guard = psutil.Process(started["starter"]).ppid()
        os.kill(started["starter"], signal.SIGSTOP)  # it will never get to its Starter.shutdown
        owner.kill()
        owner.wait()
        assert_gone([started["starter"], guard, *started["ranks"]], timeout=30)
        assert not job_dir.exists()
    finally:
        owner.kill()
        owner.wait()


def test_the_next_launcher_removes_job_directories_of_owners_that_died(tmp_path, monkeypatch):
    """Owner, guard and start process all SIGKILLed at once: no one is left to clean up, so the
    next launcher on the machine sweeps what processes that are gone owned, and nothing else."""
    import subprocess
    import sys
    import tempfile

    from taas.launch.local import jobdir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"taas-job-{gone.pid}-j1-x1y2"  # what jobdir.create made in that process
    (dead / "scratch" / "rank0").mkdir(parents=True)
    alive = jobdir.create("j2")
    jobdir.sweep()
    assert not dead.exists()
    assert pathlib.Path(alive).is_dir()  # ours: we still run
    jobdir.remove(alive)


def test_garbage_on_the_start_process_channel_never_fails_a_job(launcher, tmp_path):
    """Unreadable or unexpected messages to the start process are logged and ignored: the job
    after them (and one started while they are still being read) runs as usual."""
    import pickle

    pids, exits, _ = run(launcher, tmp_path, "echo")  # a ready start process and channel
    conn = launcher._conn
    for data in (b"not a pickle", b"", pickle.dumps({"kind": "display", "data": 5}), pickle.dumps([1, 2]),
                 pickle.dumps(("spawn", "old", str(tmp_path), "/nowhere", [], 0, ())),  # the old tuple wire
                 pickle.dumps(protocol.Stop(5, "soon")), pickle.dumps(protocol.Ready(1))[:-3]):
        conn.send_bytes(data)
    protocol.send(conn, protocol.Spawned("nobody", {"rank0": 1}))  # one the start process never expects
    protocol.send(conn, protocol.Stop("no-such-job", 0.1))  # answered with a Stopped the jobs skip
    pids, exits, output = run(launcher, tmp_path, "echo")
    assert exits == {"rank0": 0, "rank1": 0}
    assert b"hello from rank1" in output[("rank1", "stdout")]
    assert_gone(pids.values())


def test_a_gpu_lease_is_held_by_the_ranks_and_goes_with_the_last_of_them(launcher, tmp_path):
    """The session's lease (taas.leases) travels as shared fds: the ranks hold it after the
    kernel let go of its copy, one rank SIGKILLed leaves it with the other, and it is free once
    the job's processes are gone (fake GPU UUIDs: no GPU needed)."""
    import os
    import signal

    from taas.leases import locks
    from taas.leases.api import Holder

    path = str(tmp_path / "leases")
    locks.ensure(path)
    lease = locks.try_take(path, ["GPU-a", "GPU-b"], Holder("j1", "me"))
    assert lease is not None
    spec = LaunchSpec(
        job_id=f"t{time.monotonic_ns()}", cwd=str(tmp_path),
        processes=tuple(ProcessSpec(key=f"rank{i}", entry="tests.support.launch_targets:show_gpus_then_hang",
                                    env={**lease.env(), "LOCAL_RANK": str(i)}) for i in range(2)),
        shared_fds=lease.fds)
    job = launcher.start(spec)
    lease.close()  # the kernel lets go of its copy: the ranks hold the lease now
    output: dict[str, bytes] = {}
    exits: dict[str, int] = {}
    try:
        while sum(v.count(b"\n") for v in output.values()) < 2:  # the event: both ranks printed
            for ev in job.events(0.05):
                if isinstance(ev, OutputChunk):
                    output[ev.key] = output.get(ev.key, b"") + ev.data
        assert output == {"rank0": b"GPU-a,GPU-b 0 2\n", "rank1": b"GPU-a,GPU-b 1 2\n"}
        assert set(locks.held(path)) == {"GPU-a", "GPU-b"}
        os.kill(job.pids["rank0"], signal.SIGKILL)
        while "rank0" not in exits:
            for ev in job.events(0.05):
                if isinstance(ev, ProcessExit):
                    exits[ev.key] = ev.returncode
        assert set(locks.held(path)) == {"GPU-a", "GPU-b"}  # rank1 still holds both
        job.stop(grace=0.5)
        while "rank1" not in exits:
            for ev in job.events(0.05):
                if isinstance(ev, ProcessExit):
                    exits[ev.key] = ev.returncode
        assert locks.held(path) == {}
    finally:
        job.stop(grace=0.1)
        job.close()


def test_a_kept_rank_whose_main_thread_ended_is_gone_though_its_fifo_is_still_open(launcher, tmp_path):
    """A kept rank SIGKILLed between cells: its main thread ends (the process shows as a
    zombie) a moment before its other threads let go of its FIFO.  The next cell must not
    be sent to it (it would run on the others and fail): it starts on fresh ranks."""
    from taas.errors import KeptRanksGone
    from taas.launch.process import cells

    spec = LaunchSpec(job_id=f"t{time.monotonic_ns()}", cwd=str(tmp_path), processes=(
        ProcessSpec(key="rank0", entry="tests.support.launch_targets:kept_rank_whose_main_thread_ends"),))
    job = launcher.start(spec)
    try:
        out = b""
        deadline = time.monotonic() + 60
        while b"up" not in out:
            assert time.monotonic() < deadline, out
            out += b"".join(e.data for e in job.events(0.5) if isinstance(e, OutputChunk))
        pid = job.pids["rank0"]
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # the main thread's end
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert cells.unreachable(job.job_dir, ["rank0"]) is None  # the FIFO still has its reader
        assert job.lost() == "rank0 ended"
        with pytest.raises(KeptRanksGone):
            job.next_cell({}, "payload.pkl", "result.pkl")
    finally:
        job.stop(0.5)
        job.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_interrupt_as_the_start_request_goes_out_leaves_no_process(launcher, tmp_path, monkeypatch, python_sigint):
    """A Ctrl-C while a job's start request goes out is held until the request went whole, then
    raised: the processes the start process makes of it anyway are stopped, not left running."""
    import signal

    pidfile = tmp_path / "rank0"
    send = LocalLauncher._send_spawn

    def interrupted(*args):
        send(*args)
        deadline = time.monotonic() + 60
        while not pidfile.exists():  # the start process made the process
            assert time.monotonic() < deadline, "the process never started"
            time.sleep(0.01)
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, now

    monkeypatch.setattr(LocalLauncher, "_send_spawn", staticmethod(interrupted))
    spec = LaunchSpec(job_id=f"t{time.monotonic_ns()}", cwd=str(tmp_path), processes=(
        ProcessSpec(key="rank0", entry="tests.support.launch_targets:hang_and_say_pid",
                    env={"TAAS_TEST_PIDS": str(tmp_path)}),))
    with pytest.raises(KeyboardInterrupt):
        launcher.start(spec)
    monkeypatch.undo()
    assert_gone([int(pidfile.read_text())])
    pids, exits, _ = run(launcher, tmp_path, "echo")  # the launcher starts the next job as ever
    assert exits == {"rank0": 0, "rank1": 0}


def test_an_interrupt_while_the_start_process_starts_leaves_a_launcher_that_starts_jobs(tmp_path, monkeypatch,
                                                                                       python_sigint):
    """A Ctrl-C held while the start process is started is raised once the launcher can reach
    it: the next job starts (before, the launcher kept a process it had no socket to)."""
    import signal

    from taas.launch.local import launcher as module

    submit = module._spawner.submit

    def interrupted(*args, **kwargs):
        future = submit(*args, **kwargs)
        future.result()
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the process starts
        return future

    local = LocalLauncher()
    try:
        monkeypatch.setattr(local, "_fork_start", False)
        monkeypatch.setattr(module._spawner, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            local.warm()
        monkeypatch.undo()
        pids, exits, _ = run(local, tmp_path, "echo")
        assert exits == {"rank0": 0, "rank1": 0}
    finally:
        local.shutdown()


def test_an_interrupt_as_a_process_output_ends_leaves_a_job_that_closes(launcher, tmp_path, python_sigint):
    """A Ctrl-C that lands as the launcher stops reading a process's finished output (the
    restart loop's interrupt, as a failed rank exits): the job still closes, each pipe once."""
    import signal

    spec = LaunchSpec(job_id=f"t{time.monotonic_ns()}", cwd=str(tmp_path), processes=(
        ProcessSpec(key="rank0", entry="tests.support.launch_targets:echo"),))
    job = launcher.start(spec)
    selector = job._selector
    unregister = selector.unregister

    def interrupted(fd):
        key = unregister(fd)
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the pipe is let go
        return key

    selector.unregister = interrupted
    interrupts, exited, deadline = 0, False, time.monotonic() + 60
    try:
        while not exited and time.monotonic() < deadline:
            try:
                exited = any(isinstance(e, ProcessExit) for e in job.events(0.05))
            except KeyboardInterrupt:
                interrupts += 1
    finally:
        del selector.unregister
    job.close()
    assert exited and interrupts >= 1
