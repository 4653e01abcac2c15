"""A kept job's door on a Ray cluster (``--keep --detach``): where a kernel reaches the host
actor that keeps the ranks.

The host listens on a TCP port of its node's address (the address Ray gave the node) and puts
``ip:port`` in the job's record (the KV part :data:`~taas.host.ray.keys.DOOR`).  A unix socket's
``SO_PEERCRED`` has no counterpart across machines: a connection proves the job's secret (the
KV part ``secret``, under the owner's prefix) before anything it sends is unpickled, as on one
machine (taas.host.channel's framing and limits, taas.host.kept's greeting).  Anyone who can
read the cluster's KV can read that secret: a Ray cluster is one trust domain, as Ray's own
dashboard and job API are.
"""

from __future__ import annotations

import contextlib
import socket

from taas.host.ray import keys

CONNECT_TIMEOUT = 10.0  # seconds to reach a host's door (the node answers, or is gone)


class TcpDoor:
    """The host's side: a listening socket on ``ip`` (default: this node's address)."""

    def __init__(self, store, job_id: str, ip: str | None = None):
        self.store, self.job_id = store, job_id
        token = store.get(job_id, keys.SECRET)
        if not token:
            raise OSError(f"job {job_id} has no secret in the cluster's records")
        self.token = token.decode()
        if ip is None:
            import ray

            ip = ray.util.get_node_ip_address()
        self.listener = socket.create_server((ip, 0), backlog=8)
        port = self.listener.getsockname()[1]
        store.put(job_id, keys.DOOR, f"{ip}:{port}".encode())

    def admits(self, conn: socket.socket) -> bool:
        """Any peer may try: the secret is the proof (see the module docstring).  Frames go
        out as they are written (a cell's last frames are not held back by Nagle)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(Exception):  # broad: the GCS may be gone with the cluster
            self.store.delete(self.job_id, keys.DOOR)


def knock(store, job_id: str) -> tuple[socket.socket, str]:
    """A connection to the kept job's host and the secret to prove (OSError: no door, or the
    host does not answer)."""
    door = store.get(job_id, keys.DOOR)
    token = store.get(job_id, keys.SECRET)
    if not door or not token:
        raise OSError(f"job {job_id} has no door")
    ip, _, port = door.decode().rpartition(":")
    sock = socket.create_connection((ip, int(port)), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, token.decode()
