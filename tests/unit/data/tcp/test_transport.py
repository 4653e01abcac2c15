"""The TCP transport on loopback: loader workers stream units to relays, which fill the ranks'
shared-memory rings; every connection proves the job's secret; a job leaves nothing behind."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import threading
import time
import uuid

import psutil
import pytest
import torch

from taas import directive
from taas.data.shm import segment
from taas.data.tcp import wire
from taas.data.plane import DataPlane
from taas.data.tcp.relay import Relay, fifo_directory, header_name
from taas.data.tcp.transport import TcpTransport
from taas.data.transport import BLOCKED, DATA, PASS_END, attach, resolve
from taas.data.view import LoaderView
from taas.launch.api import ProcessSpec
from tests.support.data import job_shm, run_hook, same, structures
from tests.support import forks
from tests.support.forks import exit_code, fork_job_process, no_leftover_children  # noqa: F401 (an autouse fixture)
from tests.support.data import read_to_end

TCP = "taas.data.tcp.transport:TcpTransport"
MiB = 1 << 20

def fork(spec: ProcessSpec, job_dir: str) -> int:
    """Run a job process (a loader worker or a relay) as a launcher would: ``entry(spec)``."""
    return fork_job_process(resolve(spec.entry), spec, job_dir)


def wait_for(predicate, what: str, timeout: float = 120.0):
    """Poll for an event; ``timeout`` is only reached by a real failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def listening(port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.net_connections(kind="inet"))


def taas_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("taas-") and "view" not in t.name]


def run_job(plane: DataPlane, job_id: str, tmp_path, ranks: int):
    """Start the job's workers and relays, read every rank's view to its end; returns the units
    each rank got and the listening ports the job had."""
    specs = plane.processes({})
    relays = [s for s in specs if s.key.startswith("data-relay:")]
    assert [s.entry for s in relays] == ["taas.data.tcp.transport:relay_main"] * len(relays)
    pids = {s.key: fork(s, str(tmp_path)) for s in specs}
    cfg = plane.settings["data"]
    assert pickle.loads(pickle.dumps(cfg["address"])) == cfg["address"]
    assert "Secret(<hidden>)" in repr(cfg["address"])  # the secret never shows in a repr
    views = [LoaderView(cfg, rank) for rank in range(ranks)]
    for view in views:
        view._await_prefetch()
    transport = plane.transport
    ports = [transport.hub[1]] + [port for _, port in transport._where.values()]
    assert all(listening(port) for port in ports)
    got = {}
    threads = [threading.Thread(target=lambda v=v: got.__setitem__(v.rank, list(v))) for v in views]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = plane.snapshot()
    for view in views:
        view._close()
    codes = {key: exit_code(pid) for key, pid in pids.items()}
    assert set(codes.values()) == {0}, codes  # the relays end once their ranks have gone
    return got, snapshot, ports


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_unit_arrives_once_and_equal_through_relays(registered, tmp_path, nodes):
    values = structures() * 2
    data = registered(values)
    options = directive.parse_options(f"--gpus 2 --cpus 2 --units {len(values)}")
    plane = DataPlane.plan({"data": data}, options, 2, "cpu")
    job_id = uuid.uuid4().hex[:12]
    transport = TCP if nodes == 1 else functools.partial(TcpTransport, ranks_per_node=1)
    threads_before = taas_threads()
    plane.open(job_id, transport)
    try:
        got, snapshot, ports = run_job(plane, job_id, tmp_path, ranks=2)
        assert [len(plane.processes({})) - 2] == [nodes]  # one relay per GPU node
        for rank in (0, 1):
            assert len(got[rank]) == len(values) // 2
            for i, value in enumerate(got[rank]):
                assert same(values[rank + 2 * i], value), (rank, i)
        assert [s["worker"] for s in snapshot] == [0, 1]
        assert all(s["prefetched"] and s["waiting"] is None for s in snapshot)
    finally:
        plane.close()
    assert job_shm(job_id) == []
    assert not [p for p in os.listdir(os.path.dirname(fifo_directory(job_id, 0))) if job_id in p]
    assert not any(listening(port) for port in ports)
    assert taas_threads() == threads_before


def test_connections_without_the_secret_are_closed_logged_and_get_nothing(caplog):
    job_id = uuid.uuid4().hex[:12]
    transport = TcpTransport(job_id)
    relay = None
    caplog.set_level(logging.WARNING, logger="taas.data.tcp")
    try:
        address = transport.channels(0, 1, [(0, 0)], 8 * MiB)
        (spec,) = transport.processes({})
        cfg = spec.args[0]
        relay = Relay(job_id, 0, cfg["hub"], cfg["secret"], "127.0.0.1").start()  # as a thread
        relay_at = transport._where[0]
        for target in (transport.hub, relay_at):
            # No secret: the peer reads the challenge and says nothing.
            with socket.create_connection(target) as sock:
                sock.shutdown(socket.SHUT_WR)
                assert len(read_to_end(sock)) == len(wire.MAGIC) + wire.NONCE
            # A wrong secret; then a hello and a unit, as a worker would send them.
            with socket.create_connection(target) as sock:
                challenge = wire.recv_exact(sock, len(wire.MAGIC) + wire.NONCE)
                sock.sendall(wire.Secret().mac(b"client", challenge[len(wire.MAGIC):]) + bytes(wire.NONCE))
                try:
                    sock.sendall(wire.FRAME.pack(wire.HELLO, 0, 0, 0, 0, 0, 0)
                                 + wire.FRAME.pack(wire.UNIT, 0, 0, 0, 0, 0, 0))
                except OSError:  # already closed by the listener
                    pass
                assert read_to_end(sock) == b""
            with pytest.raises((wire.Refused, EOFError, OSError)):
                wire.connect_auth(target, wire.Secret())
        refused = [r for r in caplog.records if r.name == "taas.data.tcp" and "refused" in r.getMessage()]
        assert len(refused) == 6, [r.getMessage() for r in refused]
        assert all("127.0.0.1:" in r.getMessage() for r in refused)
        header = segment.Segment.attach(header_name(job_id, 0, 0))
        assert header.channel(0, segment.C_SENT_MSGS) == 0  # nothing reached the ring
        # With the secret, the same relay serves; the kernel sees what the rank waits for.
        endpoint = attach(address)
        tx, rx = endpoint.sender(0), endpoint.receiver(0)
        assert tx.put(0, torch.arange(10))
        assert torch.equal(rx.take()[0], torch.arange(10))
        endpoint.want(0, 1)
        assert transport.control(0).wanted[0][0] == 1
        header.close()
        rx.close()
        endpoint.close()
    finally:
        if relay is not None:
            relay.close()
        transport.close()
    assert job_shm(job_id) == []


def test_a_slow_rank_bounds_what_is_in_flight(tmp_path):
    job_id = uuid.uuid4().hex[:12]
    transport = TcpTransport(job_id)
    units, bound = 100, 2 * MiB
    pids = []
    try:
        address = transport.channels(0, 1, [(0, 0)], bound)
        (spec,) = transport.processes({})
        pids.append(fork(spec, str(tmp_path)))
        pids.append(fork_producer(address, units))
        endpoint = attach(address)
        rx = endpoint.receiver(0)  # attached, not reading: a rank busy elsewhere
        wait_for(lambda: transport.control(0).workers[0].state == BLOCKED, "the worker to block")
        status = transport.control(0).workers[0]
        header = segment.Segment.attach(header_name(job_id, 0, 0))
        in_ring = header.channel(0, segment.C_SENT_BYTES) - header.channel(0, segment.C_TAKEN_BYTES)
        assert 0 < in_ring <= bound
        socket_buffers = sum(int(open(f"/proc/sys/net/ipv4/tcp_{k}mem").read().split()[2]) for k in "wr")
        assert status.produced < units
        assert status.produced * MiB <= bound + socket_buffers + MiB
        for u in range(units):
            header_ = rx.peek()
            assert header_.kind == DATA and header_.unit == u
            value, _ = rx.take()
            assert torch.equal(value, torch.full((MiB // 4,), float(u)))
            del value
        assert rx.peek().kind == PASS_END
        rx.skip()
        assert exit_code(pids.pop()) == 0
        rx.close()
        assert exit_code(pids.pop()) == 0  # the relay: its only rank has gone
        header.close()
        endpoint.close()
    finally:
        transport.close()
    assert job_shm(job_id) == []


def fork_producer(address, units: int) -> int:
    def body() -> int:
        endpoint = attach(address)
        control = endpoint.worker(0)
        tx = endpoint.sender(0, lambda waiting: control.set_state(BLOCKED if waiting else 1, 0))
        for u in range(units):
            assert tx.put(u, torch.full((MiB // 4,), float(u)))
            control.produced(u + 1)
        tx.end_pass(0, units)
        control.set_state(3)
        return 0
    return forks.fork(body)


def test_the_cleanup_hook_removes_a_killed_relays_memory(tmp_path):
    """A kernel that died with a relay killed: the launcher's hook removes what it left."""
    job_id = uuid.uuid4().hex[:12]
    transport = TcpTransport(job_id)
    try:
        transport.channels(0, 2, [(0, 0), (1, 0)], 8 * MiB)
        (spec,) = transport.processes({})
        pid = fork(spec, str(tmp_path))
        wait_for(lambda: os.path.isdir(fifo_directory(job_id, 0)), "the relay to set up")
        assert job_shm(job_id)
        os.kill(pid, 9)
        exit_code(pid)
        run_hook(transport.cleanup())
        assert job_shm(job_id) == [] and not os.path.exists(fifo_directory(job_id, 0))
    finally:
        transport.close()


class _Sink:
    def __init__(self):
        self.lines = []

    def write(self, stream, text):
        self.lines.extend(text.splitlines())

    def progress(self, key, stream, text, final):
        pass


def test_a_local_launcher_job_runs_over_tcp_relays(registered):
    """The plane starts the relays as job processes; the ranks' views are unchanged."""
    import glob
    import re
    import tempfile

    from taas.launch.api import Topology
    from taas.launch.local.launcher import LocalLauncher
    from taas.session import Session

    class TcpLocal(LocalLauncher):
        def topology(self, world):  # a node, and so a relay, per rank
            return Topology(rank_nodes=tuple(range(world)), node_ids=(), kernel_machine=False)

    def relay_leftovers():
        return ({n for n in os.listdir("/dev/shm") if re.match(r"taas-.*-n\d+-", n)}
                | set(glob.glob(os.path.join(tempfile.gettempdir(), "taas-*-relay-n*"))))

    before = relay_leftovers()
    data = registered([torch.full((1000,), float(i)) for i in range(40)])
    session = Session(launcher=TcpLocal())
    try:
        sink = _Sink()
        options = directive.parse_options("--gpus 2 --cpus 2 --units 40")
        cell = "import os\nprint('SUM', os.environ['RANK'], sum(float(x[0]) for x in data))"
        session.run_cell(cell, {"data": data}, options, sink=sink)
    finally:
        session.close()
    assert "[rank0] SUM 0 380.0" in sink.lines and "[rank1] SUM 1 400.0" in sink.lines, sink.lines
    assert any("40/40 units delivered to 2 ranks" in line for line in sink.lines), sink.lines
    assert relay_leftovers() - before == set()


def test_on_a_launcher_node_the_cleanup_hook_frees_only_that_nodes_share(monkeypatch):
    """Nodes that share a machine (a simulated cluster): one node's hook (a CPU node's, when
    its loader workers ended) must not unlink the rings that another node's ranks still read."""
    from taas.data.tcp.relay import node_of, remove_node
    from taas.data.tcp.transport import cleanup

    assert [node_of(r, (0, 0, 1, 1, 1)) for r in range(5)] == [0, 0, 1, 1, 1]  # a placement
    assert [node_of(r, 2) for r in range(4)] == [0, 0, 1, 1] and node_of(3, None) == 0
    job_id = uuid.uuid4().hex[:12]
    transport = TcpTransport(job_id, ranks_per_node=(0, 1), node_ids=("gpu-a", "gpu-b"))
    try:
        for node in (0, 1):
            segment.Segment.create(header_name(job_id, node, 0), segment.Layout(1, 1, MiB)).close()
            os.makedirs(fifo_directory(job_id, node))
        entry, args = transport.cleanup()
        monkeypatch.setenv("TAAS_NODE_ID", "cpu-c")  # no relay there: nothing of it to free
        cleanup(*args)
        assert len(job_shm(job_id)) == 2
        monkeypatch.setenv("TAAS_NODE_ID", "gpu-b")
        cleanup(*args)
        assert job_shm(job_id) == [header_name(job_id, 0, 0)] and os.path.isdir(fifo_directory(job_id, 0))
        assert not os.path.exists(fifo_directory(job_id, 1))
        monkeypatch.delenv("TAAS_NODE_ID")  # the kernel's own machine: everything of the job
        cleanup(*args)
        assert job_shm(job_id) == [] and not os.path.exists(fifo_directory(job_id, 0))
    finally:
        transport.close()
        for node in (0, 1):
            remove_node(job_id, node)
