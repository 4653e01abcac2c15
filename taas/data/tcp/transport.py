"""The multi-machine transport: units over one TCP stream per (loader worker, GPU node).

Loader workers may run on other machines than the ranks.  Each GPU node runs a *relay*
(:mod:`taas.data.tcp.relay`, a job process: :meth:`TcpTransport.processes`) that owns the
node's shared-memory rings; a worker sends each unit, encoded with :func:`encode`, on its
stream to the rank's node, and the relay receives the bytes straight into the ring's block.
Ranks read the rings with the shared-memory receiver, so their views do not change.

    kernel           TcpTransport: a per-job secret, the *hub* (listens on ``host``, port 0)
    GPU node n       relay: listens on its node's address (port 0), registers it with the hub,
                     gets the job's layout (loaders: workers, (worker, rank) pairs, bound)
    loader worker    asks the hub where node n's relay is, connects, sends HELLO(loader, worker)

Every connection (to the hub, to a relay) starts with the challenge-response on the job's
secret (:mod:`taas.data.tcp.wire`); one without it is closed, logged on ``taas.data.tcp``, and
gets nothing but the challenge.  The secret travels in the processes' settings (the Address,
the relay's arguments) and never in a repr.

A worker opens a stream to every GPU node of its loader, including nodes whose ranks it does
not feed: there it carries only CONTROL frames, since every rank waits for every worker's first
slice.  What travels on a stream (frames of :data:`tcp_wire.FRAME`)::

    worker -> relay   HELLO; UNIT (channel, unit, the pickled structure, buffer and blob tables,
                      then the blob bytes); END (a pass ended); CONTROL (the worker's state,
                      unit, units produced, first slice ready, with a sequence number)
    relay -> worker   GONE(channel): that rank closed or died; its units are dropped

Control state: the relay writes what CONTROL frames say into its node's header words, so a
rank's ``prefetched(w)`` reads them as on one machine; ranks write the unit they wait for
there as well.  CONTROL frames wait behind the unit being sent; so while the relay waits for
room in a worker's ring it marks that worker BLOCKED (and prefetched) itself.  The kernel's
``control()`` asks every relay for its node's words (durations, not clock readings) and merges
them: a worker BLOCKED on any node is BLOCKED, otherwise the report with the highest sequence
number wins.

Kept ranks (``--keep``): a loader worker that fails in a kept cell must not stop the ranks, so
:meth:`TcpTransport.fail` sends a ``Fail`` message to every relay, which marks it in its node's
header as the one-machine transport marks its own (:meth:`taas.data.shm.segment.Segment.
set_failure`); the ranks' views read it there (``failure()``).  A kept rank closes its views at
its cell's end: ``release`` frees its receivers' fds and mappings, and the endpoint's
:meth:`TcpEndpoint.close` unmaps its node's headers.

Backpressure: a relay stops reading a stream while the unit's ring is full, the TCP window
fills, and the worker's send waits (``on_wait`` after 0.1 s without progress).  In flight per
stream: the ring's bound plus the sockets' buffers.

Ends: a worker that is DONE shuts its side down and reads until the relay closes (closing with
unread bytes would reset the connection and lose what was still in flight).  The kernel's
:meth:`TcpTransport.close` closes the hub, which ends the relays; a relay also ends when every
rank of its node has gone, and removes its node's segments and FIFO directory.  The cleanup hook
removes everything of the job on the machine it runs on.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from taas.data.shm import segment
from taas.data.tcp import messages, wire
from taas.data.tcp.nodes import node_of, remove_node
from taas.data.tcp.relay import relay_main  # noqa: F401 (RELAY_ENTRY names it in this module)
from taas.data.transport import BLOCKED, STARTING, Address, ControlState, Hook, Transport, WorkerStatus
from taas.io import keys

ENDPOINT = "taas.data.tcp.endpoint:TcpEndpoint"
RELAY_ENTRY = "taas.data.tcp.transport:relay_main"
QUERY_S = 5.0  # a relay that does not answer a control query in this long is left out


class TcpTransport(Transport):
    """The kernel side.  ``host``: the kernel's address the relays and workers reach;
    ``ranks_per_node``: which GPU node each rank is on -- an int (rank r is on node
    r // ranks_per_node), a sequence (rank r is on node ``ranks_per_node[r]``: the launcher's
    placement, :attr:`taas.launch.api.Topology.rank_nodes`) or None (one node);
    ``relay_host``: where relays listen, unless their ``TAAS_DATA_HOST`` says otherwise;
    ``node_ids``: each GPU node's launcher id (``TAAS_NODE_ID``), by node number, so that the
    cleanup hook run on one node frees only that node's memory (:func:`cleanup`)."""

    def __init__(self, job_id: str, host: str = "127.0.0.1", ranks_per_node: "int | tuple | None" = None,
                 relay_host: str | None = None, node_ids: "tuple[str, ...] | None" = None):
        if ranks_per_node is not None and not isinstance(ranks_per_node, int):
            ranks_per_node = tuple(int(n) for n in ranks_per_node)  # travels in settings: small, picklable
        super().__init__(job_id)
        self.host, self.ranks_per_node, self.relay_host = host, ranks_per_node, relay_host or host
        self.node_ids = tuple(node_ids) if node_ids else None
        self.secret = wire.Secret()
        self.layouts: dict[int, messages.LoaderLayout] = {}
        self.failures: dict[int, messages.Fail] = {}  # loader -> its first failed worker (kept ranks)
        self.relays: dict[int, tuple] = {}  # node -> (socket, lock): control queries
        self._where: dict[int, tuple] = {}  # node -> (host, port) its relay listens on
        self.cond = threading.Condition()
        self.closed = False
        self.started = time.monotonic()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._wake_r, self._wake_w = os.pipe()
        self.listener = wire.listen(host)
        self.hub = (host, self.listener.getsockname()[1])
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="taas-data-hub", daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the contract ----------------------------------------------------------------------
    def channels(self, loader, workers, pairs, buffer_bytes) -> Address:
        pairs = [(int(w), int(r)) for w, r in pairs]
        with self.cond:
            self.layouts[loader] = messages.LoaderLayout(int(workers), tuple(pairs), int(buffer_bytes))
        return Address(ENDPOINT, {"job": self.job_id, "loader": loader, "hub": self.hub, "secret": self.secret,
                                  "pairs": pairs, "ranks_per_node": self.ranks_per_node})

    def processes(self, env: dict) -> list:
        """The relays, one per GPU node that hosts a rank (``ProcessSpec.node``: the launcher
        places it on that node)."""
        from taas.launch.api import ProcessSpec

        nodes = sorted({node_of(rank, self.ranks_per_node) for layout in self.layouts.values()
                        for _, rank in layout.pairs})
        settings = {"job": self.job_id, "hub": self.hub, "secret": self.secret, "host": self.relay_host}
        return [ProcessSpec(key=keys.relay_key(node), role=keys.RELAY, node=node, entry=RELAY_ENTRY,
                            env=dict(env), storage="strict",
                            args=(dict(settings, node=node),)) for node in nodes]

    def control(self, loader: int) -> ControlState:
        layout = self.layouts[loader]
        reports = []
        with self.cond:
            links = list(self.relays.items())
        for node, (sock, lock) in links:
            try:
                with lock:
                    sock.settimeout(QUERY_S)
                    wire.send_message(sock, messages.Query(loader))
                    try:
                        reports.append(wire.recv_message(sock, messages.ControlReport))
                    except messages.BadMessage as exc:  # that node's words are left out this time
                        wire.log.warning("taas data plane: ignored a control report of node %d: %s", node, exc)
                    sock.settimeout(None)
            except (OSError, EOFError):  # that relay has gone (its node's ranks ended)
                with self.cond:
                    if self.relays.get(node, (None,))[0] is sock:
                        del self.relays[node]
                sock.close()
        return _merge(layout, reports, time.monotonic() - self.started)

    def fail(self, loader: int, worker: int, text: str) -> None:
        """Every relay marks the failure in its node's header for the ranks' views; a relay
        that registers later gets it with the job's layout (both under ``cond``: none is
        missed).  The first failure of a loader is the one its views raise."""
        with self.cond:
            if loader in self.failures or self.closed:
                return
            failed = self.failures[loader] = messages.Fail(int(loader), int(worker), text)
            links = list(self.relays.items())
        for node, (sock, lock) in links:
            try:
                with lock:
                    sock.settimeout(QUERY_S)
                    wire.send_message(sock, failed)
                    try:
                        wire.recv_message(sock, messages.ControlReport)  # its acknowledgement
                    except messages.BadMessage as exc:  # still one reply: in step
                        wire.log.warning("taas data plane: node %d answered a failure oddly: %s", node, exc)
                    sock.settimeout(None)
            except (OSError, EOFError):  # that relay has gone (its node's ranks ended)
                wire.log.warning("taas data plane: could not tell node %d's relay that loader %d failed",
                                 node, loader)

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            socks = list(self._socks) + [s for s, _ in self.relays.values()]
            self.relays.clear()
        os.write(self._wake_w, b"x")
        for sock in socks:
            _shut(sock)  # the relays see the end: the job is over
        self._threads[0].join(timeout=10)  # the accept thread: no new thread after it
        for thread in self._threads[1:]:
            thread.join(timeout=10)
        self.listener.close()
        for sock in socks:
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        cleanup(self.job_id)

    def cleanup(self) -> Hook:
        return (f"{__name__}:cleanup", (self.job_id, self.node_ids))

    # -- the hub ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            ready = wire.ready(self.listener, self._wake_r)
            if self._wake_r in ready:
                return
            try:
                sock, _ = self.listener.accept()
            except OSError:  # a connection reset before we took it: take the next
                continue
            with self.cond:
                if self.closed:
                    sock.close()
                    return
                self._socks.add(sock)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._spawn(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        keep = False
        try:
            if not wire.accept_auth(sock, self.secret, "data hub"):
                return
            message = wire.recv_message(sock, messages.RelayUp, messages.WhereIs)
            if isinstance(message, messages.RelayUp):
                with self.cond:
                    wire.send_message(sock, messages.JobLayout(dict(self.layouts), self.ranks_per_node,
                                                               tuple(self.failures.values())))
                    if not self.closed:
                        self.relays[message.node] = (sock, threading.Lock())
                        self._where[message.node] = (message.host, message.port)
                        keep = True
                        self.cond.notify_all()
            else:
                with self.cond:
                    while message.node not in self._where and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    host, port = self._where[message.node]
                wire.send_message(sock, messages.RelayAt(host, port))
        except messages.BadMessage as exc:  # ignored: the connection closes, the job goes on
            wire.log.warning("taas data plane: the data hub ignored a message it cannot read: %s", exc)
        except (OSError, EOFError):  # a peer that went away mid-request: nothing to answer
            pass
        finally:
            with self.cond:
                self._socks.discard(sock)
            if not keep:
                sock.close()


def _merge(layout: messages.LoaderLayout, reports: list, age: float) -> ControlState:
    """One loader's control state from its relays' reports: a worker BLOCKED on any node is
    BLOCKED, otherwise the report with the highest sequence number wins; ``age``: how long
    the transport has been up (a worker no relay has heard of is STARTING since then)."""
    workers = []
    for w in range(layout.workers):
        seen = [r.workers[w] for r in reports if w < len(r.workers) and r.workers[w] is not None]
        if not seen:
            workers.append(WorkerStatus(STARTING, 0, age, False, 0))
            continue
        blocked = [s for s in seen if s.blocked and s.state == BLOCKED]
        last = blocked[0] if blocked else max(seen, key=lambda s: s.seq)
        workers.append(WorkerStatus(last.state, last.unit, last.busy_s, any(s.prefetched for s in seen),
                                    max(s.produced for s in seen)))
    wanted = {c: v for r in reports for c, v in r.wanted.items() if c < len(layout.pairs)}
    return ControlState(workers, wanted)


def cleanup(job_id: str, node_ids: "tuple[str, ...] | None" = None) -> None:
    """Remove every segment and FIFO directory of job ``job_id`` on this machine (any process:
    the kernel's, or the launcher's when the kernel died).  Other nodes' relays remove theirs.

    Run by a node's launcher process (``TAAS_NODE_ID`` set, one of ``node_ids``) it removes
    only that node's share, and on a node without a relay nothing: nodes that share a machine
    (a simulated cluster) must not unlink each other's rings while their ranks still read --
    a CPU node's loader workers end, and their node's hook runs, before the ranks are done."""
    here = os.environ.get("TAAS_NODE_ID")
    if node_ids and here:
        for node, node_id in enumerate(node_ids):
            if node_id == here:
                remove_node(job_id, node)
        return
    segment.unlink_job(job_id)
    remove_node(job_id)  # every node's, by whole names: never the next attempt's (taas-<job>-1-…)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass
