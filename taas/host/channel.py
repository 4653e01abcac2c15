"""A kept job's socket (``--keep --detach``): framing, the per-job secret, listening, connecting.

The host listens on a named unix socket in the job's record folder (the folder 0700, the socket
0600).  Every connection proves the job's secret before anything else: a random token the host
writes 0600 beside the record, compared with :func:`hmac.compare_digest`; the peer must also be
this user (``SO_PEERCRED``).  Until then nothing the peer sent is unpickled: the first frame
is JSON only, and small.

A frame: two lengths (``!II``), a JSON header naming one of :data:`taas.host.api.WIRE`'s typed
messages and its fields, then a body of raw bytes (a pickled Job, an outcome, or nothing).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import pathlib
import secrets
import signal
import socket
import struct
import threading

from taas.host.api import SECRET, SOCKET, WIRE
from taas.jobs.store import write_file

_HEAD = struct.Struct("!II")
HEADER_LIMIT = 16 << 20  # bytes of JSON in one frame's header (a Show of a big display)
HELLO_LIMIT = 4096  # the first frame, before the secret is proven: small, JSON, no body


class ProtocolError(Exception):
    """A frame that is not one of ours (too big, not JSON, an unknown kind)."""


def send(sock: socket.socket, message, body: bytes = b"") -> None:
    # default=str: a display's value JSON cannot carry shows as its text, never fails the cell
    header = json.dumps({**message.__dict__, "kind": type(message).__name__}, default=str).encode()
    frame = _HEAD.pack(len(header), len(body)) + header
    if len(body) < 1 << 16:  # one write for a small frame; a big body is not copied
        sock.sendall(frame + body)
    else:
        sock.sendall(frame)
        sock.sendall(body)


def recv(sock: socket.socket, header_limit: int = HEADER_LIMIT, body_limit: int | None = None):
    """The next frame: (message, body).  EOFError when the peer closed; ProtocolError for a
    frame that is not one of ours (over the limits, not JSON, an unknown kind)."""
    sizes = _exactly(sock, _HEAD.size)
    head, size = _HEAD.unpack(sizes)
    if head > header_limit or (body_limit is not None and size > body_limit):
        raise ProtocolError(f"a frame of {head} + {size} bytes is over the limit")
    header = _exactly(sock, head)
    body = _exactly(sock, size) if size else b""
    return decode(header), body


def decode(header: bytes):
    try:
        fields = json.loads(header)
        kind = WIRE[fields.pop("kind")]
        return kind(**fields)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"not a taas message: {type(exc).__name__}") from None


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the secret ------------------------------------------------------------------------------
def make_secret(folder: pathlib.Path) -> str:
    """A new random token for the job in ``folder``, written there 0600."""
    token = secrets.token_hex(32)
    write_file(pathlib.Path(folder) / SECRET, token.encode())
    return token


def read_secret(folder: pathlib.Path) -> str:
    return (pathlib.Path(folder) / SECRET).read_text().strip()


def proves(expected: str, offered: object) -> bool:
    """Whether ``offered`` is the job's token (in constant time)."""
    return isinstance(offered, str) and hmac.compare_digest(expected.encode(), offered.encode())


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[2]


# -- the socket ------------------------------------------------------------------------------
@contextlib.contextmanager
def _address(folder: pathlib.Path):
    """The socket's path, short enough for AF_UNIX (108 bytes): the folder's own, or the same
    folder through an fd of this process (``/proc/self/fd/N``) when that path is too long."""
    path = str(pathlib.Path(folder) / SOCKET)
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET}"
    finally:
        os.close(fd)


def listen(folder: pathlib.Path) -> socket.socket:
    """The host's listening socket in ``folder`` (0600; a stale one of a dead host replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pathlib.Path(folder) / SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with _address(folder) as address:
            sock.bind(address)
    finally:
        os.umask(old)
    os.chmod(pathlib.Path(folder) / SOCKET, 0o600)
    sock.listen(8)
    return sock


def connect(folder: pathlib.Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(folder) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


class UnixDoor:
    """How a kept job's host on this machine is reached: the socket in the job's folder; a
    connection must come from this user and prove the secret written beside it.  (A host on a
    Ray cluster has its own door: taas.host.ray.door.)"""

    def __init__(self, folder: pathlib.Path):
        self.folder = pathlib.Path(folder)
        self.token = make_secret(self.folder)
        self.listener = listen(self.folder)

    def admits(self, conn: socket.socket) -> bool:
        return peer_uid(conn) == os.getuid()

    def close(self) -> None:
        self.listener.close()
        remove(self.folder)


def knock(folder: pathlib.Path) -> tuple[socket.socket, str]:
    """A connection to the kept job's host whose folder is ``folder``, and the secret to prove
    (OSError: the host is gone)."""
    token = read_secret(folder)
    return connect(folder), token


def remove(folder: pathlib.Path) -> None:
    """The socket and the secret gone (the kept ranks ended)."""
    for name in (SOCKET, SECRET):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pathlib.Path(folder) / name)


@contextlib.contextmanager
def noting(noted: list):
    """SIGINT only noted in ``noted`` for the block (in the main thread, where Python's handler
    is set), so that reading a frame is never cut in half."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
