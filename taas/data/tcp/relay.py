"""The receiving side of the TCP transport: one relay per GPU node and job.

The relay owns its node's shared memory exactly as the kernel and the producers own it in the
one-machine transport (:mod:`taas.data.shm.transport`): per loader a header segment
``taas-<job>-n<node>-<loader>`` and the channel FIFOs in ``<tmp>/taas-<job>-relay-n<node>``
(the names: :mod:`taas.data.tcp.nodes`),
and a :class:`~taas.data.shm.ring.ShmSender` per channel whose rank is on this node.  The ranks read
them with the shared-memory receiver: their views do not change.

    start()   listen on ``host`` (port 0: the OS picks), connect to the kernel's hub, register
              (node, host, port), receive the job's layout, make the segments and FIFOs (the FIFO
              directory appears last, renamed into place: the ranks wait for it)
    threads   accept: one thread per loader worker's stream; each authenticates it, reads its
              frames in order, and receives a unit's bytes from the socket straight into the
              block the ring lends (one copy); while a ring is full it stops reading, so the
              TCP window fills and the worker blocks
              hub: answers the kernel's control queries from the header words, and marks a
              loader's failure there when the kernel says one failed (kept ranks)
              watch: tells a worker when a rank it feeds here has gone (GONE frames)
    stop()    when every rank here has gone, the hub connection ends (the kernel closed the
              job's transport) or SIGTERM: close everything, unlink this node's segments and
              remove its FIFO directory

Worker state: the worker's CONTROL frames set its words in the header (when the relay read
them); while the relay waits for room in one of the worker's rings it marks the worker BLOCKED
(and prefetched: a full buffer is as ready as it gets) itself, since the worker's own frames
are stuck behind the unit it waits to put.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time

from taas.data.shm import segment
from taas.data.shm.ring import ShmSender
from taas.data.tcp import messages, wire
from taas.data.tcp.nodes import fifo_directory, header_name, node_of, remove_node
from taas.data.transport import BLOCKED, DONE

POLL_S = 0.1


class _Loader:
    def __init__(self, header: segment.Segment, pairs: list, local: dict):
        self.header, self.pairs = header, pairs
        self.senders: dict[int, ShmSender] = local  # channel -> sender, channels of this node
        self.last: dict[int, tuple] = {}  # worker -> (seq, state, unit, since, produced)
        self.blocked: dict[int, float] = {}  # worker -> since when the relay waits for its ring
        self.current = 0  # the unit being put into a ring


class Relay:
    def __init__(self, job_id: str, node: int, hub: tuple, secret: wire.Secret, host: str = "127.0.0.1"):
        self.job_id, self.node, self.hub_address, self.secret, self.host = job_id, node, tuple(hub), secret, host
        self.loaders: dict[int, _Loader] = {}
        self.conns: dict[tuple[int, int], socket.socket] = {}  # (loader, worker) -> its stream
        self.announced: set[tuple[int, int]] = set()  # (loader, channel) whose rank has gone
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.listener = self.hub = None
        self._wake_r, self._wake_w = os.pipe()

    # -- setup -----------------------------------------------------------------------------
    def start(self) -> "Relay":
        try:
            self.listener = wire.listen(self.host)
            port = self.listener.getsockname()[1]
            self.hub = wire.connect_auth(self.hub_address, self.secret)
            wire.send_message(self.hub, messages.RelayUp(self.node, self.host, port))
            # Without a readable layout there is nothing to serve: BadMessage fails the relay.
            self._make(wire.recv_message(self.hub, messages.JobLayout))
        except BaseException:  # half set up: release what was made, then re-raised
            self.close()
            raise
        for target in (self._accept, self._answer, self._watch):
            self._thread(target)
        return self

    def _make(self, layout: messages.JobLayout) -> None:
        per_node = layout.ranks_per_node
        staging = tempfile.mkdtemp(prefix=f"{segment.SHM_PREFIX}{self.job_id}-relay-n{self.node}-new-")
        try:
            for loader, spec in sorted(layout.loaders.items()):
                pairs = list(spec.pairs)
                shape = segment.Layout(spec.workers, len(pairs), spec.bound // max(len(pairs), 1))
                header = segment.Segment.create(header_name(self.job_id, self.node, loader), shape)
                item = self.loaders[loader] = _Loader(header, pairs, {})
                for channel, (worker, rank) in enumerate(pairs):
                    if node_of(rank, per_node) == self.node:  # opened here: the same FIFOs once renamed
                        paths = segment.make_fifos(staging, loader, channel)
                        item.senders[channel] = ShmSender(header, channel, paths, self._on_wait(loader, worker))
            for failed in layout.failures:  # marked before this relay registered
                self._mark(failed)
            os.rename(staging, fifo_directory(self.job_id, self.node))  # the ranks may attach now
        except BaseException:  # never leave the staging directory behind; re-raised
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=f"taas-relay-{target.__name__}", daemon=True)
        self.threads.append(thread)
        thread.start()

    # -- worker streams --------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.stopping.is_set():
            ready = wire.ready(self.listener, self._wake_r)
            if self.stopping.is_set() or self._wake_r in ready:
                return
            try:
                sock, _ = self.listener.accept()
            except OSError:  # the listener closed under us: stopping
                return
            self._thread(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        if not wire.accept_auth(sock, self.secret, f"data relay of node {self.node}"):
            return
        key = None
        try:
            head = memoryview(bytearray(wire.FRAME.size))
            wire.recv_into_exact(sock, head)
            kind, _, _, loader, worker, _, _ = wire.FRAME.unpack(head)
            item = self.loaders.get(loader)
            if kind != wire.HELLO or item is None or worker >= item.header.layout.workers:
                wire.log.warning("taas data plane: relay of node %d: a stream opened with a bad hello", self.node)
                return
            key = (loader, worker)
            with self.lock:
                self.conns[key] = sock
                gone = [c for (ld, c) in self.announced if ld == loader and item.pairs[c][0] == worker]
            for channel in gone:
                self._gone(sock, channel)
            self._frames(sock, loader, worker, item, head)
        except (OSError, EOFError):  # the worker went (its job ends) or we are stopping
            pass
        finally:
            with self.lock:
                if key is not None and self.conns.get(key) is sock:
                    del self.conns[key]
            sock.close()

    def _frames(self, sock, loader: int, worker: int, item: _Loader, head: memoryview) -> None:
        """Read the worker's frames until its stream ends.  A frame this relay cannot use (an
        unknown kind, a channel that is not this worker's here) is logged and skipped, with its
        payload; only a UNIT whose sizes cannot be trusted ends the stream, since where its
        next frame starts is then unknown."""
        while not self.stopping.is_set():
            wire.recv_into_exact(sock, head)
            kind, channel, unit, a, b, c, d = wire.FRAME.unpack(head)
            if kind == wire.CONTROL:
                if b & 0xFF > DONE:
                    self._bad(f"a worker state {b & 0xFF}", loader, worker)
                else:
                    self._control(item, worker, a, b & 0xFF, c, d, bool(b >> 8 & 1))
                continue
            if kind not in (wire.UNIT, wire.END):
                self._bad(f"a frame of kind {kind}", loader, worker)
                continue  # fixed-size: the next frame follows
            sender = item.senders.get(channel)
            if sender is not None and item.pairs[channel][0] != worker:
                sender = None  # another worker's channel
            if kind == wire.END:
                if sender is None:
                    self._bad(f"a pass end for channel {channel}", loader, worker)
                else:
                    sender.end_pass(a, unit)
                continue
            if not self._unit(sock, item, sender, unit, a, b, c, d):
                self._bad(f"a unit for channel {channel} with sizes it cannot trust (meta {a}, tables "
                          f"{b}+{c}, blob area {d}); the stream ends", loader, worker)
                return
            if sender is None:
                self._bad(f"a unit for channel {channel}", loader, worker)

    def _unit(self, sock, item: _Loader, sender: ShmSender | None, unit: int, meta_len: int, nbuf: int,
              nblob: int, area: int) -> bool:
        """Read a UNIT frame's payload into ``sender``'s ring (or discard it: no sender, or the
        rank has gone).  False when its sizes are not consistent: the blob bytes are left
        unread, and where the next frame starts is unknown."""
        if meta_len > wire.MAX_META or nbuf + nblob > wire.MAX_ENTRIES or area > wire.MAX_AREA:
            return False
        meta = wire.recv_exact(sock, meta_len)
        entries = list(wire.ENTRY.iter_unpack(wire.recv_exact(sock, wire.ENTRY.size * (nbuf + nblob))))
        if any(offset + nbytes > area for offset, nbytes in entries):
            return False  # a blob outside the blob area: its bytes would land elsewhere
        buffers, blobs = entries[:nbuf], entries[nbuf:]
        if sender is None:
            _discard(sock, sum(n for _, n in blobs))
            return True
        item.current = unit

        def write(mm, blob_at: int) -> None:
            with memoryview(mm) as view:
                for offset, nbytes in blobs:
                    wire.recv_into_exact(sock, view[blob_at + offset:blob_at + offset + nbytes])

        if not sender.put_raw(unit, meta, buffers, area, write):
            _discard(sock, sum(n for _, n in blobs))  # the rank has gone: its bytes go nowhere
        return True

    def _bad(self, what: str, loader: int, worker: int) -> None:
        wire.log.warning("taas data plane: relay of node %d ignored %s from loader %d worker %d",
                         self.node, what, loader, worker)

    def _gone(self, sock: socket.socket, channel: int) -> None:
        try:
            sock.sendall(wire.FRAME.pack(wire.GONE, channel, 0, 0, 0, 0, 0))
        except OSError:  # the worker has gone too
            pass

    # -- control words ---------------------------------------------------------------------
    def _control(self, item: _Loader, worker: int, seq: int, state: int, unit: int, produced: int,
                 prefetched: bool) -> None:
        header, now = item.header, time.monotonic()
        last = item.last.get(worker)
        since = last[3] if last and (last[1], last[2]) == (state, unit) else now
        item.last[worker] = (seq, state, unit, since, produced)
        header.set_worker(worker, segment.W_PRODUCED, produced)
        if prefetched or state == DONE:
            header.set_worker(worker, segment.W_PREFETCHED, 1)
        if worker not in item.blocked:
            header.set_worker_state(worker, state, unit, since)

    def _on_wait(self, loader: int, worker: int):
        def on_wait(waiting: bool) -> None:
            item = self.loaders[loader]
            header = item.header
            if waiting:
                item.blocked[worker] = time.monotonic()
                header.set_worker_state(worker, BLOCKED, item.current)
                header.set_worker(worker, segment.W_PREFETCHED, 1)  # as ready as it gets
            else:
                item.blocked.pop(worker, None)
                last = item.last.get(worker)
                if last is not None:
                    header.set_worker_state(worker, last[1], last[2], last[3])

        return on_wait

    def snapshot(self, loader: int) -> messages.ControlReport:
        """This node's view of loader ``loader``: per worker what it last reported here (None
        if it never did), and the channels whose rank waits for a unit: {channel: (unit,
        waited s)}.  Durations, not times: they mean the same on the kernel's machine."""
        item = self.loaders.get(loader)
        if item is None:
            return messages.ControlReport((), {})
        header, now = item.header, time.monotonic()
        workers = []
        for w in range(header.layout.workers):
            last = item.last.get(w)
            if last is None and w not in item.blocked:
                workers.append(None)
                continue
            workers.append(messages.WorkerReport(
                header.worker(w, segment.W_STATE), header.worker(w, segment.W_UNIT),
                max(now - header.worker_since(w), 0.0), bool(header.worker(w, segment.W_PREFETCHED)),
                header.worker(w, segment.W_PRODUCED), last[0] if last else 0, w in item.blocked))
        wanted = {}
        for channel in item.senders:
            want = header.channel(channel, segment.C_WANT)
            if want:
                wanted[channel] = (want - 1, max(now - header.want_since(channel), 0.0))
        return messages.ControlReport(tuple(workers), wanted)

    def _mark(self, failed: messages.Fail) -> None:
        """A worker of loader ``failed.loader`` failed (kept ranks): its views here raise it."""
        item = self.loaders.get(failed.loader)
        if item is not None and failed.worker < item.header.layout.workers:
            item.header.set_failure(failed.worker, failed.text)

    def _answer(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    message = wire.recv_message(self.hub, messages.Query, messages.Fail)
                    if isinstance(message, messages.Fail):
                        self._mark(message)
                        reply = messages.ControlReport((), {})  # one reply per message
                    else:
                        reply = self.snapshot(message.loader)
                except messages.BadMessage as exc:  # ignored; an empty report keeps query and reply in step
                    wire.log.warning("taas data plane: relay of node %d ignored a message from the hub: %s",
                                     self.node, exc)
                    reply = messages.ControlReport((), {})
                wire.send_message(self.hub, reply)
        except (OSError, EOFError):  # the kernel closed the job's transport: the job is over
            pass
        self.stop()

    def _watch(self) -> None:
        while not self.stopping.wait(POLL_S):
            pending, every = [], True
            for loader, item in self.loaders.items():
                for channel, sender in item.senders.items():
                    if not sender.gone:
                        every = False
                    elif (loader, channel) not in self.announced:
                        pending.append((loader, channel, item.pairs[channel][0]))
            with self.lock:
                for loader, channel, _ in pending:
                    self.announced.add((loader, channel))
                sends = [(self.conns.get((ld, w)), c) for ld, c, w in pending]
            for sock, channel in sends:
                if sock is not None:
                    self._gone(sock, channel)
            if every and any(item.senders for item in self.loaders.values()):
                self.stop()  # every rank here has gone: nothing more to deliver
                return

    # -- end -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop serving (from any thread; :meth:`close` releases)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        os.write(self._wake_w, b"x")
        for item in self.loaders.values():
            for sender in item.senders.values():
                sender._gone = True  # a stream waiting for ring space gives up
        with self.lock:
            socks = list(self.conns.values())
        for sock in socks + ([self.hub] if self.hub else []):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by its peer
                pass

    def close(self) -> None:
        """Stop, wait for the threads, remove this node's shared memory and FIFOs."""
        self.stop()
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        for sock in (self.listener, self.hub):
            if sock is not None:
                sock.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1
        for item in self.loaders.values():
            for sender in item.senders.values():
                sender.close()
            try:
                item.header.close()
            except BufferError:  # a view of it is still alive somewhere; unlinked below regardless
                pass
        self.loaders.clear()
        remove_node(self.job_id, self.node)


def _discard(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes:
        got = sock.recv_into(scratch[:min(nbytes, scratch.nbytes)])
        if not got:
            raise EOFError("connection closed")
        nbytes -= got


def relay_main(spec) -> int:
    """A relay as a job process (``ProcessSpec(key="data-relay:<node>", entry=
    "taas.data.tcp.transport:relay_main", args=(settings,))``), placed on GPU node ``node``.
    ``TAAS_DATA_HOST`` in its environment, when set, is the address it listens on (the node's
    address that loader workers reach); exits 0 when its ranks have gone, the kernel closed the
    transport, or at SIGTERM."""
    cfg = spec.args[0]
    host = os.environ.get("TAAS_DATA_HOST") or cfg["host"]
    relay = Relay(cfg["job"], cfg["node"], cfg["hub"], cfg["secret"], host)
    terminated = []
    # Only a flag: the handler runs in this thread, which may hold a lock that stop() takes.
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    try:
        relay.start()
        while not (terminated or relay.stopping.is_set()):
            time.sleep(POLL_S)
        return 0
    except BaseException as exc:  # reported like a loader worker's failure: the job shows it
        job_dir = os.environ.get("TAAS_JOB_DIR")
        if job_dir:
            from taas.launch.process import report

            report.write_error(job_dir, spec.key, exc, 1)
        else:
            raise
        return 1
    finally:
        relay.close()
