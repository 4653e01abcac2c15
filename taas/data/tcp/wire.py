"""What travels on the TCP transport's sockets: the per-job secret, the handshake, the frames.

Every connection starts with a challenge-response on the job's secret (HMAC-SHA256), before
the side that listens sends anything but its challenge::

    listener -> connector   MAGIC (8 bytes) + a fresh nonce (32)
    connector -> listener   HMAC(secret, "client" + nonce) (32) + a nonce of its own (32)
    listener                compare_digest: wrong, or nothing within HANDSHAKE_S -> one log line
                            on ``taas.data.tcp``, the connection closed, nothing else sent
    listener -> connector   HMAC(secret, "server" + its nonce) (32): the connector checks it too

A fresh nonce per connection on both sides: a recorded handshake cannot be replayed.

After it, data streams carry binary frames (:data:`FRAME`, 48 bytes, then a payload) and the
kernel's hub carries small JSON messages (``u32`` length + UTF-8 JSON), typed in
:mod:`taas.data.tcp.messages`.  Nothing read from a socket is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct

from taas.data.tcp import messages
from taas.ready import IN, OUT, poll

log = logging.getLogger("taas.data.tcp")

MAGIC = b"taasdat1"
NONCE = 32
HANDSHAKE_S = 10.0  # a peer that says nothing is dropped after this long

# Data-stream frames: kind, channel, unit, a, b, c, d
FRAME = struct.Struct("<IIQQQQQ")
HELLO = 1  # a: loader, b: worker (first frame of a loader worker's stream)
UNIT = 2  # a: meta bytes, b: buffers, c: blobs, d: blob area bytes; then the payload
END = 3  # unit: the first unit of the next pass, a: the pass that ended
CONTROL = 4  # a: sequence number, b: state | prefetched << 8, c: unit, d: units produced
GONE = 5  # relay -> worker: the rank on ``channel`` has gone
ENTRY = struct.Struct("<2Q")  # (offset, nbytes) of a buffer or a blob
# What a relay trusts a UNIT frame to say (beyond, the stream ends: its sizes are garbage).
MAX_META = 1 << 28  # bytes of pickled structure (tensors and arrays travel in the blob area)
MAX_ENTRIES = 1 << 24  # buffers and blobs
MAX_AREA = 1 << 44  # bytes of blob area
_LEN = struct.Struct("<I")
MAX_MESSAGE = 1 << 24


class Secret:
    """A job's secret: bytes that ``repr`` (and so a logged address or settings dict) hides."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | None = None):
        self.value = value if value is not None else secrets.token_bytes(32)

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    def __reduce__(self):
        return (Secret, (self.value,))

    def __eq__(self, other) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self.value, other.value)

    def __hash__(self) -> int:
        return hash(Secret)

    def mac(self, role: bytes, nonce: bytes) -> bytes:
        return hmac.new(self.value, role + nonce, hashlib.sha256).digest()


class Refused(ConnectionError):
    """The peer failed the handshake."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise EOFError("connection closed")
        view = view[got:]


def accept_auth(sock: socket.socket, secret: Secret, what: str) -> bool:
    """The listening side's handshake; False (logged, ``sock`` closed) for a peer without the
    secret.  ``what``: which listener, for the log line."""
    try:
        peer = "%s:%s" % sock.getpeername()[:2]
    except OSError:
        peer = "?"
    nonce = secrets.token_bytes(NONCE)
    try:
        sock.settimeout(HANDSHAKE_S)
        sock.sendall(MAGIC + nonce)
        answer = recv_exact(sock, 32 + NONCE)
        ok = hmac.compare_digest(answer[:32], secret.mac(b"client", nonce))
        if ok:
            sock.sendall(secret.mac(b"server", answer[32:]))
            sock.settimeout(None)
            return True
        reason = "wrong secret"
    except (OSError, EOFError) as exc:  # timeouts included: the peer did not authenticate
        reason = f"no secret ({type(exc).__name__})"
    log.warning("taas data plane: %s refused a connection from %s: %s", what, peer, reason)
    sock.close()
    return False


def connect_auth(address: tuple[str, int], secret: Secret) -> socket.socket:
    """A connection to a taas listener, authenticated both ways; raises :class:`Refused`."""
    sock = socket.create_connection(tuple(address), timeout=HANDSHAKE_S)
    try:
        hello = recv_exact(sock, len(MAGIC) + NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise Refused(f"{address} is not a taas data listener")
        mine = secrets.token_bytes(NONCE)
        sock.sendall(secret.mac(b"client", hello[len(MAGIC):]) + mine)
        if not hmac.compare_digest(recv_exact(sock, 32), secret.mac(b"server", mine)):
            raise Refused(f"{address} does not know the job's secret")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except BaseException:  # EOFError, OSError, Refused, Ctrl-C: never leak the socket; re-raised
        sock.close()
        raise


def listen(host: str) -> socket.socket:
    """A listening socket on ``host``, its port picked by the OS (never probed, then bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:  # never leak the socket; re-raised
        sock.close()
        raise
    return sock


def send_message(sock: socket.socket, message: messages.Message) -> None:
    """Send a hub message (:mod:`taas.data.tcp.messages`): ``u32`` length + UTF-8 JSON."""
    data = json.dumps(messages.encode(message)).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket, *expected: type) -> messages.Message:
    """The next hub message, one of ``expected`` (any if none).  :class:`messages.BadMessage`
    when its bytes are not one (the connection stays usable: the next message starts after
    it); EOFError when the connection ended, or announced a message too big to read."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise EOFError(f"message of {n} bytes")
    data = recv_exact(sock, n)
    try:
        decoded = json.loads(data)
    except ValueError as exc:  # not UTF-8, not JSON
        raise messages.BadMessage(f"not JSON ({exc}): {data[:200]!r}") from None
    return messages.decode(decoded, *expected)


def ready(sock: socket.socket | int, *more: socket.socket | int, timeout: float | None = None,
          write: bool = False) -> dict[int, int]:
    """Which of these descriptors can be read (or, ``write``: ``sock`` written), waiting up to
    ``timeout`` s (None: until one can): descriptor -> poll(2) events (taas.ready)."""
    return poll([(sock, IN | (OUT if write else 0))] + [(f, IN) for f in more], timeout)
