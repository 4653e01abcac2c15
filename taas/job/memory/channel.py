"""The results channel: how rank 0's big result storages reach the kernel (one machine).

One ``SOCK_SEQPACKET`` socketpair per job (for kept ranks, per kept set), made by the kernel;
its rank end travels to the job's processes as the last of ``LaunchSpec.shared_fds`` (index in
:data:`CHANNEL_ENV`).  Three typed messages, each a fixed-size header, never a pickle::

    rank 0 ─ Regions(token, first, total, [(address, nbytes), ...]) ─> kernel   "read these"
    kernel ─ Answer(token, status) ──────────────────────────────────> rank 0   (rank 0 waits)
    rank 0 ─ Files(token, first) + memfds as SCM_RIGHTS ──────────────> kernel   (if not READ)

The kernel's end is served by a thread (:class:`ResultChannel`): it reads the regions out of
rank 0's memory the moment they are asked for (:mod:`taas.job.memory.readback`; the sender's
pid is the one the socket vouches for, ``SO_PASSCRED``) and answers, so rank 0 can exit or run
its next cell as soon as it is answered.  What was read or sent waits under its token until the
session takes it (:meth:`ResultChannel.take`) when it loads the results; everything else, and
everything at :meth:`ResultChannel.close`, is dropped: nothing ever has a name, so a failed job
or a killed kernel leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from taas.job.memory import readback
from taas.ready import readable, wait_readable
from taas.shield import deferred_interrupt

CHANNEL_ENV = "TAAS_RESULT_CHANNEL"  # index, in TAAS_SHARED_FDS, of the results channel
SHARED_FDS_ENV = "TAAS_SHARED_FDS"
MAX_FDS_PER_BATCH = 200  # SCM_RIGHTS carries at most 253 fds in one message
MAX_REGIONS_PER_MESSAGE = 256
READ, UNREADABLE, FAILED = 0, 1, 2  # Answer.status: taken; never ask again; send files this time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Files:
    """Rank 0's memory files ``first``, ``first + 1``, ... of ``token``; the fds follow."""

    token: bytes  # 16 random bytes: which rank-0 results these belong to
    first: int

    KIND, _FORMAT = 1, "<B16sI"

    def pack(self) -> bytes:
        return struct.pack(self._FORMAT, self.KIND, self.token, self.first)


@dataclass(frozen=True)
class Regions:
    """Rank 0's storages ``first``, ``first + 1``, ... of ``token`` (``total`` in all), as
    (address, nbytes) in rank 0's memory."""

    token: bytes
    first: int
    total: int
    regions: tuple[tuple[int, int], ...]

    KIND, _FORMAT, _REGION = 2, "<B16sII", "<QQ"

    def pack(self) -> bytes:
        head = struct.pack(self._FORMAT, self.KIND, self.token, self.first, self.total)
        return head + b"".join(struct.pack(self._REGION, *r) for r in self.regions)


@dataclass(frozen=True)
class Answer:
    """The kernel's answer to ``token``'s regions: READ, UNREADABLE or FAILED."""

    token: bytes
    status: int

    KIND, _FORMAT = 3, "<B16sB"

    def pack(self) -> bytes:
        return struct.pack(self._FORMAT, self.KIND, self.token, self.status)


def unpack(data: bytes) -> Files | Regions | Answer | None:
    """One message, or None when it is not one of ours."""
    if not data or data[0] not in (Files.KIND, Regions.KIND, Answer.KIND):
        return None
    try:
        if data[0] == Files.KIND and len(data) == struct.calcsize(Files._FORMAT):
            return Files(*struct.unpack(Files._FORMAT, data)[1:])
        if data[0] == Answer.KIND and len(data) == struct.calcsize(Answer._FORMAT):
            return Answer(*struct.unpack(Answer._FORMAT, data)[1:])
        head, size = struct.calcsize(Regions._FORMAT), struct.calcsize(Regions._REGION)
        if data[0] == Regions.KIND and len(data) >= head and (len(data) - head) % size == 0:
            _, token, first, total = struct.unpack(Regions._FORMAT, data[:head])
            regions = tuple(struct.unpack_from(Regions._REGION, data, at) for at in range(head, len(data), size))
            return Regions(token, first, total, regions)
    except struct.error:
        pass
    return None


# -- the kernel's end --------------------------------------------------------------------------
class ResultChannel:
    """One job's channel, kernel side: :meth:`rank_end` goes to the processes, a thread serves
    rank 0's requests, :meth:`take` collects a token's storages or files, :meth:`close` drops
    whatever is left."""

    def __init__(self):
        self._kernel, self._rank = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._kernel.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._kernel.setblocking(False)
        self._lock = threading.Lock()
        self._files: dict[bytes, dict[int, int]] = {}  # token -> index -> fd
        self._asked: dict[bytes, tuple[int, dict[int, tuple[int, int]]]] = {}  # token -> pid, regions
        self._read: dict[bytes, list] = {}  # token -> the storages read
        self.readable = True  # False once reading rank 0's memory was refused: files from then on
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="taas-results")
        self._thread.start()

    def rank_end(self) -> int:
        """The fd to pass to the job's processes (owned by the channel; valid until close)."""
        return self._rank.fileno()

    def take(self, token: bytes, count: int) -> list | None:
        """The ``count`` storages rank 0 asked to be read under ``token`` (untyped storages),
        or the files it sent instead (fds: the caller closes them), in order; None when they
        did not all arrive.  Everything else held or queued is dropped."""
        room_for_fds(count)
        with self._lock:
            self._drain()
            read, files = self._read.pop(token, None), self._files.pop(token, {})
            self._drop()
        if read is not None and len(read) == count:
            close_fds(files.values())
            return read
        if all(i in files for i in range(count)):
            close_fds(fd for i, fd in files.items() if i >= count)
            return [files[i] for i in range(count)]
        log.warning("rank 0's results: %d of %d storages arrived", len(files) if read is None else len(read),
                    count)
        close_fds(files.values())
        return None

    def close(self) -> None:
        """Both ends; what was read or queued goes with them (rank 0 waiting sees the end).
        One step: a Ctrl-C half-way would leave the descriptors open and the channel marked
        closed (an interrupt fuzz leaked four descriptors at a time so)."""
        with deferred_interrupt():
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                os.write(self._wake_w, b"x")
            if self._thread is not threading.current_thread():
                self._thread.join()
            with self._lock:
                self._drop()
                self._kernel.close()
                self._rank.close()
                os.close(self._wake_r)
                os.close(self._wake_w)

    # -- the serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            readable([self._kernel, self._wake_r])  # poll(2): a kernel may hold fds past 1023
            with self._lock:
                if self._closed:
                    return
                try:
                    self._drain()
                except Exception:  # never leave rank 0 waiting on a thread that died
                    log.exception("taas: the results channel failed")
                    self._kernel.shutdown(socket.SHUT_RDWR)
                    return

    def _drain(self) -> None:
        """Handle every message queued (under the lock)."""
        for message, fds, pid in self._messages():
            if isinstance(message, Files):
                held = self._files.setdefault(message.token, {})
                for i, fd in enumerate(fds, message.first):
                    if i in held:
                        os.close(fd)
                    else:
                        held[i] = fd
                continue
            close_fds(fds)
            if isinstance(message, Regions) and pid > 0:
                _, asked = self._asked.setdefault(message.token, (pid, {}))
                asked.update(enumerate(message.regions, message.first))
                if len(asked) >= message.total:
                    self._answer(message.token, message.total)

    def _answer(self, token: bytes, total: int) -> None:
        pid, asked = self._asked.pop(token)
        status = UNREADABLE if not self.readable else FAILED
        if self.readable and all(i in asked for i in range(total)):
            try:
                started = time.perf_counter()
                self._read[token] = readback.read(pid, [asked[i] for i in range(total)])
                status = READ
                log.debug("read %d storages of rank 0 in %.3f s", total, time.perf_counter() - started)
            except readback.Unreadable as exc:
                log.info("taas: the kernel may not read rank 0's memory (%s): results come as files", exc)
                self.readable = False
                status = UNREADABLE
            except (OSError, RuntimeError) as exc:  # no memory for them, or rank 0 went
                log.debug("reading rank 0's results failed: %s", exc)
        try:
            self._kernel.send(Answer(token, status).pack(), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as exc:
            log.debug("results channel: no answer sent: %s", exc)

    def _messages(self):
        size = socket.CMSG_SPACE(MAX_FDS_PER_BATCH * 4) + socket.CMSG_SPACE(struct.calcsize("iII"))
        while True:
            try:
                data, ancdata, flags, _ = self._kernel.recvmsg(64 << 10, size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("results channel: %s", exc)
                return
            if not data and not ancdata:
                return
            fds: list[int] = []
            pid = 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]))
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
                    pid = struct.unpack_from("iII", payload)[0]
            whole = not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
            yield unpack(data) if whole else None, fds, pid

    def _drop(self) -> None:
        for held in self._files.values():
            close_fds(held.values())
        self._files.clear()
        self._asked.clear()
        self._read.clear()


# -- rank 0 ------------------------------------------------------------------------------------
def channel_from(environ) -> int | None:
    """The results channel's fd in this process (rank 0), or None: no channel (a cluster, or a
    launcher that passes no files) means big values travel inline."""
    try:
        index = int(environ[CHANNEL_ENV])
        return int(environ.get(SHARED_FDS_ENV, "").split(",")[index])
    except (KeyError, ValueError, IndexError):
        return None


_unreadable = False  # the kernel said it may not read this process: files from now on


def ask_to_read(channel: int, token: bytes, regions: list[tuple[int, int]]) -> bool:
    """Ask the kernel to read ``regions`` of this process's memory and wait for it to have:
    True when it did (they may change from now on); False when files must be sent instead;
    OSError when the channel is gone (the kernel closed it, or it went)."""
    global _unreadable
    if _unreadable:
        return False
    readback.allow_reader(channel)
    sock = socket.socket(fileno=os.dup(channel))  # never made non-blocking: the ranks share it
    try:
        for first in range(0, len(regions), MAX_REGIONS_PER_MESSAGE):
            part = tuple(regions[first:first + MAX_REGIONS_PER_MESSAGE])
            sock.sendmsg([Regions(token, first, len(regions), part).pack()], [], socket.MSG_NOSIGNAL)
        while True:
            wait_readable(sock, None)
            try:
                data = sock.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not data:
                raise OSError("the kernel closed the results channel")
            answer = unpack(data)
            if isinstance(answer, Answer) and answer.token == token:
                _unreadable = answer.status == UNREADABLE
                return answer.status == READ
    finally:
        sock.close()


def send_files(channel: int, token: bytes, fds: list[int]) -> None:
    """``fds`` to the kernel under ``token``, in batches; OSError when the channel refuses."""
    sock = socket.socket(fileno=os.dup(channel))
    try:
        for first in range(0, len(fds), MAX_FDS_PER_BATCH):
            part = fds[first:first + MAX_FDS_PER_BATCH]
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(part)}i", *part))]
            sock.sendmsg([Files(token, first).pack()], rights, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    finally:
        sock.close()


def room_for_fds(count: int) -> None:
    """Raise our soft open-file limit towards the hard one so that ``count`` more fit (a
    kernel's soft limit is often 1024); where it cannot, the files that do not fit are lost
    (MSG_CTRUNC) and their values come back with a note."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_fds() + count + 64
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        except (ValueError, OSError):
            pass


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def close_fds(fds) -> None:
    """Close each fd, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
