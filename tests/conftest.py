"""Fixtures shared by the real-kernel tests and the simulated-cluster tests."""

import psutil
import pytest

from tests.support.cluster import SimulatedCluster, missing_requirements

from tests.support.kernel_driver import (Kernel, cmdline, listening_ports, process_name, shm_entries,
                                 unmapped_shm, wait_for, wait_until_gone)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The notebook's working directory of the module's kernel."""
    return tmp_path_factory.mktemp("notebook")


@pytest.fixture(scope="module")
def kernel(request, workdir):
    """One real kernel per test module, in ``workdir``, with taas loaded; the module's
    ``KERNEL_ENV`` (a dict, if it defines one) added to its environment.  A module that needs
    another kernel defines its own ``kernel`` fixture."""
    k = Kernel(str(workdir), env=getattr(request.module, "KERNEL_ENV", None))
    yield k
    k.shutdown()


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
    extra = [p for p in kernel.descendants() if "taas.launch.local.starter" not in " ".join(cmdline(p))]
    assert wait_until_gone([p.pid for p in extra]) == [], [cmdline(p) for p in extra]
    guards = [p for p in kernel.descendants() if p not in extra and p.ppid() == kernel.pid]
    assert len(guards) <= 1
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
