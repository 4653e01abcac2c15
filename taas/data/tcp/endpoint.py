"""The TCP transport's job-process side: a loader worker's streams, a rank's local rings.

A loader worker (:class:`TcpEndpoint` ``.worker``/``.sender``) asks the kernel's hub where each
GPU node's relay listens, opens one authenticated stream per node and sends its units and
CONTROL frames there (the protocol: :mod:`taas.data.tcp.transport`).  A rank (``.receiver``,
``.want``, ``.prefetched``) reads its node's shared-memory rings, made by the relay, with the
shared-memory endpoint: nothing of TCP on the rank's side.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from taas.data.shm.transport import ENDPOINT as SHM_ENDPOINT
from taas.data.tcp import messages, wire
from taas.data.tcp.nodes import fifo_directory, header_name, node_of
from taas.data.transport import DONE, Address, Endpoint, Sender, WorkerControl, attach, encode
from taas.ready import IN, OUT

WAIT_S = 0.1  # a send without progress this long counts as waiting for buffer space
COALESCE = 64 * 1024  # blobs smaller than this are sent with the frame's head
WHERE_TRIES = 3  # questions to the hub before a loader worker gives up on a relay


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
                else:  # fixed-size frames: the next one is still in step
                    wire.log.warning("taas data plane: a loader worker ignored a frame of kind %d from a relay", kind)
            self._inbox = self._inbox[whole:]

    def send(self, parts: list, on_wait=None) -> bool:
        if self.dead or self.finished:
            return False
        self.busy = True
        try:
            if self.pending is not None:
                frame, self.pending = self.pending, None
                self._write(memoryview(frame), None)
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
        """Send a CONTROL frame now if the socket takes it, else with the next send: never
        wait for it (only the newest state matters)."""
        if self.dead or self.finished:
            return
        if self.busy:
            self.pending = frame
            return
        self.pending = None
        try:
            sent = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            self.pending = frame
            return
        except OSError:  # the relay has gone
            self.dead = True
            return
        if sent < len(frame):  # a frame is never cut: finish it (the buffer has room again soon)
            self.send([frame[sent:]])

    def _write(self, view: memoryview, on_wait) -> None:
        waiting = False
        try:
            while view.nbytes:
                try:
                    view = view[self.sock.send(view):]
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                events = wire.ready(self.sock, timeout=WAIT_S, write=True).get(self.sock.fileno(), 0)
                if events & IN:
                    self.poll()  # GONE frames: the relay must never wait for us to read
                if not events & OUT and on_wait is not None and not waiting:
                    waiting = True
                    on_wait(True)
        finally:
            if waiting:
                on_wait(False)

    def finish(self) -> None:
        """Everything is sent: shut our side down, read until the relay closes its side."""
        if self.finished or self.dead:
            return
        if self.pending is not None:
            self.send([])  # the last state out first
        self.finished = True
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the relay has gone already
            pass
        while not self.dead:
            wire.ready(self.sock, timeout=1.0)
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
            relay = self._where(node)
            sock = wire.connect_auth((relay.host, relay.port), self.secret)
            sock.sendall(wire.FRAME.pack(wire.HELLO, 0, 0, self.loader, worker, 0, 0))
            if self.control.seq:
                sock.sendall(self.control.frame())
            stream = self.streams[node] = _Stream(sock)
        return stream

    def _where(self, node: int) -> messages.RelayAt:
        """Where node ``node``'s relay listens, as the hub says; an answer that cannot be read
        is logged and the question asked again (on a new connection), WHERE_TRIES times."""
        for _ in range(WHERE_TRIES):
            hub = wire.connect_auth(self.hub, self.secret)
            try:
                wire.send_message(hub, messages.WhereIs(node))
                return wire.recv_message(hub, messages.RelayAt)
            except messages.BadMessage as exc:
                wire.log.warning("taas data plane: a loader worker ignored an answer of the data hub: %s", exc)
            finally:
                hub.close()
        raise ConnectionError(f"the data hub never said where node {node}'s relay is")

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

    def failure(self) -> str | None:
        """The kernel's line about this loader's failed worker, as the relay of this rank's
        node marked it (kept ranks), or None."""
        for local in list(self._local.values()):
            failed = local.failure()
            if failed is not None:
                return failed
        return None

    def close(self) -> None:
        for stream in self.streams.values():
            stream.finish()
            stream.close()
        self.streams.clear()
        while self._local:  # a kept rank's view, at its cell's end: unmap the node's headers
            _, local = self._local.popitem()
            local.close()
