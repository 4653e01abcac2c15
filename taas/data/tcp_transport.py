"""The multi-machine transport: units over one TCP stream per (loader worker, GPU node).

Loader workers may run on other machines than the ranks.  Each GPU node runs a *relay*
(:mod:`taas.data.tcp_relay`, a job process: :meth:`TcpTransport.processes`) that owns the
node's shared-memory rings; a worker sends each unit, encoded with :func:`encode`, on its
stream to the rank's node, and the relay receives the bytes straight into the ring's block.
Ranks read the rings with the shared-memory receiver, so their views do not change.

    kernel           TcpTransport: a per-job secret, the *hub* (listens on ``host``, port 0)
    GPU node n       relay: listens on its node's address (port 0), registers it with the hub,
                     gets the job's layout (loaders: workers, (worker, rank) pairs, bound)
    loader worker    asks the hub where node n's relay is, connects, sends HELLO(loader, worker)

Every connection (to the hub, to a relay) starts with the challenge-response on the job's
secret (:mod:`taas.data.tcp_wire`); one without it is closed, logged on ``taas.data.tcp``, and
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

import glob
import os
import select
import shutil
import socket
import tempfile
import threading
import time

from taas.data import segment, tcp_wire as wire
from taas.data.shm_transport import ENDPOINT as SHM_ENDPOINT
from taas.data.tcp_relay import fifo_directory, header_name, node_of, relay_main  # noqa: F401
from taas.data.transport import (
    BLOCKED, DONE, STARTING, Address, ControlState, Endpoint, Hook, Sender, Transport, WorkerControl,
    WorkerStatus, attach, encode,
)

ENDPOINT = "taas.data.tcp_transport:TcpEndpoint"
RELAY_ENTRY = "taas.data.tcp_transport:relay_main"
QUERY_S = 5.0  # a relay that does not answer a control query in this long is left out
WAIT_S = 0.1  # a send without progress this long counts as waiting for buffer space
COALESCE = 64 * 1024  # blobs smaller than this are sent with the frame's head


class TcpTransport(Transport):
    """The kernel side.  ``host``: the kernel's address the relays and workers reach;
    ``ranks_per_node``: rank r is on GPU node r // ranks_per_node (None: one node);
    ``relay_host``: where relays listen, unless their ``TAAS_DATA_HOST`` says otherwise."""

    def __init__(self, job_id: str, host: str = "127.0.0.1", ranks_per_node: int | None = None,
                 relay_host: str | None = None):
        super().__init__(job_id)
        self.host, self.ranks_per_node, self.relay_host = host, ranks_per_node, relay_host or host
        self.secret = wire.Secret()
        self.layouts: dict[int, dict] = {}
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
        pairs = [tuple(p) for p in pairs]
        with self.cond:
            self.layouts[loader] = {"workers": workers, "pairs": pairs, "bound": int(buffer_bytes)}
        return Address(ENDPOINT, {"job": self.job_id, "loader": loader, "hub": self.hub, "secret": self.secret,
                                  "pairs": pairs, "ranks_per_node": self.ranks_per_node})

    def processes(self, env: dict) -> list:
        """The relays, one per GPU node that hosts a rank (key ``data-relay:<node>``: the
        launcher places it on that node)."""
        from taas.launch.api import ProcessSpec

        nodes = sorted({node_of(rank, self.ranks_per_node) for layout in self.layouts.values()
                        for _, rank in layout["pairs"]})
        settings = {"job": self.job_id, "hub": self.hub, "secret": self.secret, "host": self.relay_host}
        return [ProcessSpec(key=f"data-relay:{node}", entry=RELAY_ENTRY, env=dict(env), storage="strict",
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
                    wire.send_message(sock, {"op": "query", "loader": loader})
                    reports.append(wire.recv_message(sock))
                    sock.settimeout(None)
            except (OSError, EOFError, ValueError):  # that relay has gone (its node's ranks ended)
                with self.cond:
                    if self.relays.get(node, (None,))[0] is sock:
                        del self.relays[node]
                sock.close()
        workers = []
        for w in range(layout["workers"]):
            seen = [r["workers"][w] for r in reports if w < len(r["workers"]) and r["workers"][w]]
            if not seen:
                workers.append(WorkerStatus(STARTING, 0, time.monotonic() - self.started, False, 0))
                continue
            blocked = [s for s in seen if s[6] and s[0] == BLOCKED]
            state, unit, busy, _, _, _, _ = blocked[0] if blocked else max(seen, key=lambda s: s[5])
            workers.append(WorkerStatus(state, unit, busy, any(s[3] for s in seen), max(s[4] for s in seen)))
        wanted = {int(c): tuple(v) for r in reports for c, v in r["wanted"].items()}
        return ControlState(workers, wanted)

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
        return (f"{__name__}:cleanup", (self.job_id,))

    # -- the hub ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            ready, _, _ = select.select([self.listener, self._wake_r], [], [])
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
            message = wire.recv_message(sock)
            if message.get("op") == "relay":
                node = int(message["node"])
                with self.cond:
                    layout = {"loaders": {str(k): v for k, v in self.layouts.items()},
                              "ranks_per_node": self.ranks_per_node}
                    wire.send_message(sock, layout)
                    if not self.closed:
                        self.relays[node] = (sock, threading.Lock())
                        self._where[node] = (message["host"], message["port"])
                        keep = True
                        self.cond.notify_all()
            elif message.get("op") == "where":
                node = int(message["node"])
                with self.cond:
                    while node not in self._where and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    host, port = self._where[node]
                wire.send_message(sock, {"host": host, "port": port})
        except (OSError, EOFError, ValueError):  # a peer that went away mid-request: nothing to answer
            pass
        finally:
            with self.cond:
                self._socks.discard(sock)
            if not keep:
                sock.close()


def cleanup(job_id: str) -> None:
    """Remove every segment and FIFO directory of job ``job_id`` on this machine (any process:
    the kernel's, or the launcher's when the kernel died).  Other nodes' relays remove theirs."""
    segment.unlink_job(job_id)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{segment.SHM_PREFIX}{job_id}-relay-n*")):
        shutil.rmtree(path, ignore_errors=True)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass


# -- the worker's and the rank's side --------------------------------------------------------
class _Stream:
    """A loader worker's stream to one relay.  Only the worker's main thread writes; the
    watchdog thread may read GONE frames (``poll``)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.gone: set[int] = set()
        self.dead = self.finished = False
        self.busy = False  # a frame is being written: a CONTROL frame waits for its end
        self.pending: bytes | None = None
        self._inbox = b""
        self._rlock = threading.Lock()

    def poll(self) -> None:
        with self._rlock:
            while not self.dead:
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # reset: the relay has gone
                    data = b""
                if not data:
                    self.dead = True
                    break
                self._inbox += data
            whole = len(self._inbox) - len(self._inbox) % wire.FRAME.size
            for kind, channel, *_ in wire.FRAME.iter_unpack(self._inbox[:whole]):
                if kind == wire.GONE:
                    self.gone.add(channel)
            self._inbox = self._inbox[whole:]

    def send(self, parts: list, on_wait=None) -> bool:
        if self.dead or self.finished:
            return False
        self.busy = True
        try:
            for part in parts:
                self._write(memoryview(part).cast("B"), on_wait)
            self.busy = False
            if self.pending is not None:
                frame, self.pending = self.pending, None
                self._write(memoryview(frame), None)
            return True
        except OSError:  # the relay has gone (its node's job processes ended)
            self.dead = True
            return False
        finally:
            self.busy = False

    def control(self, frame: bytes) -> None:
        if self.busy:
            self.pending = frame  # only the newest state matters
        elif not (self.dead or self.finished):
            self.send([frame])

    def _write(self, view: memoryview, on_wait) -> None:
        waiting = False
        try:
            while view.nbytes:
                try:
                    view = view[self.sock.send(view):]
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                readable, writable, _ = select.select([self.sock], [self.sock], [], WAIT_S)
                if readable:
                    self.poll()  # GONE frames: the relay must never wait for us to read
                if not writable and on_wait is not None and not waiting:
                    waiting = True
                    on_wait(True)
        finally:
            if waiting:
                on_wait(False)

    def finish(self) -> None:
        """Everything is sent: shut our side down, read until the relay closes its side."""
        if self.finished or self.dead:
            return
        self.finished = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the relay has gone already
            pass
        while not self.dead:
            select.select([self.sock], [], [], 1.0)
            self.poll()

    def close(self) -> None:
        self.sock.close()


class _TcpSender(Sender):
    def __init__(self, stream: _Stream, channel: int, on_wait=None):
        self.stream, self.ch, self.on_wait = stream, channel, on_wait

    @property
    def gone(self) -> bool:
        self.stream.poll()
        return self.stream.dead or self.ch in self.stream.gone

    def draft(self):
        return None  # collated in the worker's own memory: the socket copies it anyway

    def put(self, unit: int, value, draft=None) -> bool:
        if self.gone:
            return False
        enc = encode(value)
        blobs = [(offset, nbytes, src) for offset, nbytes, src in enc.blobs if nbytes]
        head = bytearray(wire.FRAME.pack(wire.UNIT, self.ch, unit, len(enc.meta), len(enc.buffers),
                                         len(blobs), enc.nbytes))
        head += enc.meta
        for offset, nbytes in enc.buffers:
            head += wire.ENTRY.pack(offset, nbytes)
        for offset, nbytes, _ in blobs:
            head += wire.ENTRY.pack(offset, nbytes)
        parts = [head]
        for _, nbytes, src in blobs:
            raw = src if isinstance(src, memoryview) else _bytes_of(src)
            if nbytes < COALESCE and isinstance(parts[-1], bytearray):
                parts[-1] += raw
            else:
                parts.append(raw)
        return self.stream.send(parts, self.on_wait)

    def end_pass(self, pass_index: int, end_unit: int) -> bool:
        if self.gone:
            return False
        return self.stream.send([wire.FRAME.pack(wire.END, self.ch, end_unit, pass_index, 0, 0, 0)], self.on_wait)


def _bytes_of(tensor) -> memoryview:
    import torch

    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


class _Control(WorkerControl):
    """A loader worker's state, sent as CONTROL frames on each of its streams."""

    def __init__(self, endpoint: "TcpEndpoint"):
        self.endpoint = endpoint
        self.seq = self.state = self.unit = self.count = 0
        self.ready = False

    def frame(self) -> bytes:
        return wire.FRAME.pack(wire.CONTROL, 0, 0, self.seq, self.state | self.ready << 8, self.unit, self.count)

    def _push(self) -> None:
        self.seq += 1
        for stream in self.endpoint.streams.values():
            stream.control(self.frame())

    def set_state(self, state: int, unit: int = 0) -> None:
        self.state, self.unit = state, unit
        if state == DONE:
            self.ready = True  # a done worker has everything out
        self._push()
        if state == DONE:
            for stream in self.endpoint.streams.values():
                stream.finish()

    def produced(self, count: int) -> None:
        self.count = count
        self._push()

    def prefetched(self) -> None:
        self.ready = True
        self._push()


class TcpEndpoint(Endpoint):
    """A loader worker's streams to the relays, or a rank's node-local shared memory."""

    def __init__(self, address: Address):
        super().__init__(address)
        where = address.where
        self.job, self.loader, self.pairs = where["job"], where["loader"], where["pairs"]
        self.hub, self.secret, self.per_node = tuple(where["hub"]), where["secret"], where["ranks_per_node"]
        self.streams: dict[int, _Stream] = {}  # node -> stream
        self.control = _Control(self)
        self._local: dict[int, Endpoint] = {}  # node -> shared-memory endpoint

    def _node(self, channel: int) -> int:
        return node_of(self.pairs[channel][1], self.per_node)

    # -- worker side -----------------------------------------------------------------------
    def _stream(self, node: int, worker: int) -> _Stream:
        stream = self.streams.get(node)
        if stream is None:
            hub = wire.connect_auth(self.hub, self.secret)
            try:
                wire.send_message(hub, {"op": "where", "node": node})
                relay = wire.recv_message(hub)
            finally:
                hub.close()
            sock = wire.connect_auth((relay["host"], relay["port"]), self.secret)
            sock.sendall(wire.FRAME.pack(wire.HELLO, 0, 0, self.loader, worker, 0, 0))
            if self.control.seq:
                sock.sendall(self.control.frame())
            stream = self.streams[node] = _Stream(sock)
        return stream

    def sender(self, channel, on_wait=None) -> Sender:
        return _TcpSender(self._stream(self._node(channel), self.pairs[channel][0]), channel, on_wait)

    def worker(self, worker: int) -> WorkerControl:
        # A stream to every GPU node of the loader, even one whose ranks this worker does not
        # feed: every rank waits for every worker's first slice (``prefetched``).
        for node in sorted({node_of(rank, self.per_node) for _, rank in self.pairs}):
            self._stream(node, worker)
        return self.control

    # -- rank side -------------------------------------------------------------------------
    def _shm(self, node: int) -> Endpoint:
        local = self._local.get(node)
        if local is None:
            directory = fifo_directory(self.job, node)
            while not os.path.isdir(directory):  # the relay makes it last: then all is there
                time.sleep(0.005)
            local = self._local[node] = attach(Address(SHM_ENDPOINT, {
                "segment": header_name(self.job, node, self.loader), "directory": directory, "loader": self.loader}))
        return local

    def receiver(self, channel, pin_memory=False):
        return self._shm(self._node(channel)).receiver(channel, pin_memory)

    def want(self, channel: int, unit: int | None) -> None:
        self._shm(self._node(channel)).want(channel, unit)

    def prefetched(self, worker: int) -> bool:
        if len(self._local) == 1:
            (local,) = self._local.values()
        else:
            local = self._shm(node_of(int(os.environ.get("RANK", "0")), self.per_node))
        return local.prefetched(worker)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.finish()
            stream.close()
        self.streams.clear()
