"""Fixtures shared by the real-kernel tests and the simulated-cluster tests."""

import time

import pytest

from tests.cluster import SimulatedCluster, missing_requirements

from tests.kernel_driver import (cmdline, listening_ports, process_name, shm_entries,
                                 unmapped_shm, wait_until_gone)


@pytest.fixture
def clean(kernel):
    """After the test's job: no process but the warm start process, its guard (the kernel's
    child, see taas.launch.starter.main) and the idle children it forked ahead for the next
    job; no leaked /dev/shm entry, no new listening port.

    Uses the ``kernel`` fixture of the requesting test module."""
    shm_before = shm_entries()
    pids = {kernel.pid} | {p.pid for p in kernel.descendants()}
    ports_before = listening_ports(pids)
    yield
    time.sleep(0.2)
    extra = [p for p in kernel.descendants() if "taas.launch.starter" not in " ".join(cmdline(p))]
    assert wait_until_gone([p.pid for p in extra]) == [], [cmdline(p) for p in extra]
    guards = [p for p in kernel.descendants() if p not in extra and p.ppid() == kernel.pid]
    assert len(guards) <= 1
    for guard in guards:
        starters = guard.children()
        assert [process_name(s) for s in starters] in ([], ["taas-start"])
        for starter in starters:
            kept = [c for c in starter.children() if process_name(c) != "taas-ready"]
            assert wait_until_gone([c.pid for c in kept]) == [], [process_name(c) for c in kept]
    assert unmapped_shm(shm_entries() - shm_before) == set()
    pids = {kernel.pid} | {p.pid for p in kernel.descendants()}
    assert listening_ports(pids) - ports_before == set()


@pytest.fixture(scope="session")
def ray_cluster():
    """One simulated Ray cluster (tests/cluster.py: a head, 2 "GPU" nodes, 1 CPU node, in a
    private network and PID namespace) for the whole session: it takes 10-45 s to start.
    Skipped where it cannot run (not root, no unshare/nsenter/ip, no ray).  Tests must leave
    it as they found it (no placement groups or actors left behind)."""
    reason = missing_requirements()
    if reason:
        pytest.skip(f"simulated Ray cluster: {reason}")
    cluster = SimulatedCluster().start()
    yield cluster
    cluster.stop()
