"""Fixtures shared by the real-kernel tests and the simulated-cluster tests."""

import signal

import psutil
import pytest

from tests.support.cluster import SimulatedCluster, missing_requirements
from tests.support.kernel_driver import (cmdline, listening_ports, process_name, shm_entries,
                                         unmapped_shm, wait_for, wait_until_gone)
from tests.support.launchers import LOCAL, kernel_on


@pytest.fixture(scope="module")
def kernel_launcher(request):
    """The launcher the module's ``kernel`` runs, and its ``workdir`` is for: "local" unless the
    test is marked ``on_both_launchers`` (tests/support/launchers.py), which parametrizes this."""
    return getattr(request, "param", LOCAL)


@pytest.fixture(scope="module")
def _kernels_by_launcher():
    """The module's working directories and kernels, one of each per launcher, made when first
    asked for and shut down at the module's end.  Kept here rather than in ``kernel``: pytest
    sets a parametrized module fixture up again whenever its parameter changes, and a module's
    tests on both launchers interleave with its tests on the local one only, so a launcher's
    kernel must outlive an instance of ``kernel`` for each launcher to start once per module."""
    workdirs: dict = {}
    kernels: dict = {}
    yield workdirs, kernels
    for k in kernels.values():
        k.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, kernel_launcher, _kernels_by_launcher):
    """The notebook's working directory of the module's kernel (on ``kernel_launcher``)."""
    workdirs, _ = _kernels_by_launcher
    if kernel_launcher not in workdirs:
        name = "notebook" if kernel_launcher == LOCAL else f"notebook-{kernel_launcher}"
        workdirs[kernel_launcher] = tmp_path_factory.mktemp(name)
    return workdirs[kernel_launcher]


@pytest.fixture(scope="module")
def kernel(request, workdir, kernel_launcher, _kernels_by_launcher):
    """One real kernel per test module and launcher, in ``workdir``, with taas loaded; the
    module's ``KERNEL_ENV`` (a dict, if it defines one) added to its environment.  On the local
    launcher unless the test is ``on_both_launchers``.  A module that needs another kernel
    defines its own ``kernel`` fixture."""
    _, kernels = _kernels_by_launcher
    if kernel_launcher not in kernels:
        kernels[kernel_launcher] = kernel_on(kernel_launcher, str(workdir),
                                             getattr(request.module, "KERNEL_ENV", None))
    return kernels[kernel_launcher]


@pytest.fixture
def clean(kernel):
    """After the test's job: no process but the warm start process, its guard (the kernel's
    child, see taas.launch.local.starter.main) and the idle children it forked ahead for the next
    job; no leaked /dev/shm entry, no new listening port.

    Uses the ``kernel`` fixture of the requesting test module."""
    shm_before = shm_entries()
    pids = {kernel.pid} | {p.pid for p in kernel.descendants()}
    ports_before = listening_ports(pids)
    yield
    # The kernel's job host (taas.host.serve), where attached jobs run, holds a warm start
    # process of its own, as the kernel does.
    hosts = [p for p in kernel.descendants() if "taas.host.serve" in " ".join(cmdline(p))]
    extra = [p for p in kernel.descendants()
             if p not in hosts and "taas.launch.local.starter" not in " ".join(cmdline(p))]
    assert wait_until_gone([p.pid for p in extra]) == [], [cmdline(p) for p in extra]
    guards = [p for p in kernel.descendants() if p not in extra and p not in hosts
              and p.ppid() in {kernel.pid} | {h.pid for h in hosts}]
    assert len(guards) <= 1 + len(hosts)
    for guard in guards:
        starters = guard.children()
        assert [process_name(s) for s in starters] in ([], ["taas-start"])
        for starter in starters:
            # Each child ends, or is (or, just forked ahead, becomes) an idle taas-ready one.
            def settled(starter=starter):  # bound now (wait_for calls it in this iteration anyway)
                try:
                    return all(c.status() == psutil.STATUS_ZOMBIE or process_name(c) == "taas-ready"
                               for c in starter.children())
                except psutil.Error:  # one ended while we looked: look again
                    return False
            wait_for(settled, timeout=60, what="the start process's children ending or idling")
    # Only this kernel's jobs count: another program on the machine (a second test run) may
    # create and remove taas segments of its own meanwhile.
    ours = _job_ids(kernel)
    new = {name for name in shm_entries() - shm_before
           if ours is None or any(name.startswith(f"taas-{job}") for job in ours)}
    assert unmapped_shm(new) == set()
    pids = {kernel.pid} | {p.pid for p in kernel.descendants()}
    assert listening_ports(pids) - ports_before == set()


def _job_ids(kernel):
    """The ids of every job this kernel's taas session ran, or None if it cannot tell."""
    run = kernel.run("import taas as _t\nprint(','.join(getattr(_t._loaded.get('session'), 'job_ids', ['?'])))")
    text = run.stdout.strip()
    if run.error is not None or not text or text == "?":
        return None
    return set(text.split(","))


@pytest.fixture(scope="session")
def ray_cluster():
    """One simulated Ray cluster (tests/support/cluster.py: a head, 2 "GPU" nodes, 1 CPU node, in a
    private network and PID namespace) for the whole session: it takes 10-45 s to start.
    Skipped where it cannot run (not root, no unshare/nsenter/ip, no ray).  Tests must leave
    it as they found it (no placement groups or actors left behind)."""
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    cluster = SimulatedCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt in the main thread, as in a kernel, a job host or a rank,
    whatever started the test run (a shell's background job ignores SIGINT, and Python keeps
    that); restored after the test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
