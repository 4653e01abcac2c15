"""A kernel's job hosts ahead of need (taas.host.spares, taas.host.zygote), with real processes:
detached jobs back to back run on hosts the zygote forked (its children, in sessions of their own,
reaped by the system as they end);
a zygote that is gone costs a fresh host, not the job; closing ends the zygote, leaving no log."""

from __future__ import annotations

import os
import signal

import psutil

from taas import directive
from taas.host import client, detach, spares
from taas.host.spares import Hosts
from taas.jobs.api import State
from taas.jobs.store import Store
from taas.session import Session
from tests.support.sinks import Recorder


def _start(session: Session, store: Store, hosts: Hosts, body: str):
    """A detached cell, as the kernel starts one (its Session prepares the job)."""
    return detach.start_here(session, store, body, {}, directive.parse_options("--gpus 1 --detach"),
                             filename="<cell>", text=body, hidden=frozenset(), name_for=lambda name: None,
                             notebook="nb", hashed=body, sink=Recorder(), hosts=hosts)


def test_detached_jobs_back_to_back_run_on_hosts_forked_by_the_zygote(tmp_path, monkeypatch):
    monkeypatch.setenv("TAAS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(spares, "SETTLE", 0.0)  # the spare after each detach: forked at once
    store = Store()
    hosts = Hosts()
    hosts.prewarm(store)
    zygote = hosts._zygote
    assert zygote is not None
    go = tmp_path / "go"
    body = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\nprint('job', {{}})\n"
    session = Session()
    try:
        records = [_start(session, store, hosts, body.format(i)) for i in range(2)]
        running = []  # taken while they surely run: an ended host is reaped at once (no zombie)
        for record in records:  # both run at once, each on a host of its own
            host = psutil.Process(store.read(record.id).host_pid)
            running.append(host)
            assert host.ppid() == zygote.process.pid  # forked by the zygote: not ours
            assert "taas.host.zygote" in " ".join(host.cmdline())
            assert os.getsid(host.pid) == host.pid  # in a session of its own
        assert len({store.read(r.id).host_pid for r in records}) == 2
        go.touch()
        for i, record in enumerate(records):
            sink = Recorder()
            assert client.follow(store, record.id, sink).state is State.DONE
            assert f"job {i}" in sink.text()
        ended = running
        _, alive = psutil.wait_procs(ended, timeout=60)
        assert alive == []  # the hosts ended, and the zygote left no zombie of them:
        assert not {p.pid for p in ended} & {c.pid for c in psutil.Process(zygote.process.pid).children()}
        os.kill(zygote.process.pid, signal.SIGKILL)  # gone: the next host is a fresh interpreter
        zygote.process.wait()
        ready = hosts.take(store)  # the spare forked after the last job lives on without it
        assert ready.process is None and ready.alive()
        ready.close()
        spare = hosts.take(store)
        assert spare.process is not None and spare.alive()
        spare.close()
        assert spare.process.wait(timeout=60) == 0  # an idle host ends when its socket closes
    finally:
        go.touch()
        hosts.close()
        session.close()
    hosts2 = Hosts()
    hosts2.prewarm(store)
    second = hosts2._zygote
    assert second is not None
    hosts2.close()
    assert second.process.wait(timeout=60) == 0  # the zygote ends when its socket closes...
    assert not second.log.exists()  # ...and its log, empty, goes with it


def test_a_host_forked_for_a_job_forks_as_many_ranks_ahead_as_the_job_has(tmp_path, monkeypatch):
    """No spare ready (a detached cell right after another): the host forked for the job is told
    its size, so its start process forks that many children ahead while the job is handed over,
    not the machine's default (one per core, up to 8) and the rest on demand."""
    from tests.support.processes import wait_for

    monkeypatch.setenv("TAAS_HOME", str(tmp_path / "home"))
    store = Store()
    hosts = Hosts()
    hosts.prewarm(store)
    ranks = min(os.cpu_count() or 1, 8) + 2  # more than the default, so only the hint explains it
    try:
        made_ahead = hosts.take(store)  # the spare made ahead taken: none left
        # forked once the zygote is up (it imports torch first): the only host so far
        before = wait_for(lambda: _host_pids(hosts), what="the spare made ahead")
        made_ahead.close()
        host = hosts.take(store, ranks)
        pid = wait_for(lambda: min(_host_pids(hosts) - before, default=None), what="the forked host")

        def forked_ahead() -> bool:
            tree = psutil.Process(pid).children(recursive=True)
            return any(len(p.children()) == ranks for p in tree)

        wait_for(forked_ahead, what=f"{ranks} children forked ahead")
        host.close()
        psutil.Process(pid).wait(timeout=60)  # an idle host ends when its socket closes
    finally:
        hosts.close()


def _host_pids(hosts: Hosts) -> set[int]:
    """The hosts the zygote forked that run (its children are hosts)."""
    zygote = hosts._zygote
    return {c.pid for c in psutil.Process(zygote.process.pid).children()} if zygote is not None else set()
