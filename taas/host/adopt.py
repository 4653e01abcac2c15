"""The kernel's side of a kept job (``--keep --detach``): adopt its kept ranks.

``%taas attach ID`` on a job whose record reads ``kept`` connects to the host's door, proves
the job's secret and, when no other kernel holds the ranks, is welcome (:class:`Door`).  The
ranks are then this kernel's kept ranks, as if its own job host kept them: the Session's
Keeper holds a :class:`~taas.host.remote.RemoteKept` whose host is the Door, so each later taas
cell is prepared by the Session as any kept cell (the values the ranks hold left out, their
GPUs theirs already) and runs there with the frames of the kernel's own host (RunJob, Show*,
JobDone; taas.host.wire).  Ctrl-C interrupts the cell on the ranks, which stay.  Closing the
door (``%unload_ext``, the kernel's death) lets the ranks wait for the next kernel;
``%taas release`` ends them and their host.
"""

from __future__ import annotations

import logging
import os
import socket

from taas.host import channel
from taas.host.api import CellFailed, Ended, Hello, Refused, Returned, Welcome
from taas.host.cells import failure_raised
from taas.host.remote import HostLink, RemoteKept
from taas.jobs.store import JobError, Store
from taas.ready import readable

log = logging.getLogger(__name__)


class Door(HostLink):
    """This kernel's connection to the host of a kept job's ranks, once welcome (a
    :class:`HostLink`: its Session's kept cells run there)."""

    inline_fds = True  # the host may be on another machine (a cluster's door): files as bytes

    def __init__(self, store: Store, job_id: str, notebook: str = "", knock=None):
        """``knock()``: (a connection to the host, the secret to prove), OSError when the host
        is gone; default: the socket in the job's folder on this machine (channel.knock)."""
        super().__init__()
        self.record = job_id
        try:
            sock, token = knock() if knock is not None else channel.knock(store.folder(job_id))
        except OSError:
            raise JobError(f"taas: job {job_id}'s kept ranks cannot be reached: their host is gone "
                           f"(`taas jobs` says how it ended)") from None
        try:
            channel.send(sock, Hello(token, os.getpid(), notebook))
            answer, _ = channel.recv(sock)
        except (OSError, EOFError, channel.ProtocolError) as exc:
            sock.close()
            raise JobError(f"taas: job {job_id}'s host did not answer: {exc}") from None
        if not isinstance(answer, Welcome):
            sock.close()
            raise JobError(answer.line if isinstance(answer, Refused) else
                           f"taas: job {job_id}'s host answered {type(answer).__name__}")
        self.sock = sock
        self.welcome: Welcome = answer

    def describe(self) -> str:
        w = self.welcome
        return f"{w.ranks} on {w.device}/{w.backend}"

    def kept(self, launcher) -> RemoteKept:
        """The kernel's bookkeeping of the ranks (their cells run on ``launcher``'s side: this
        machine's, or the cluster's whose host actor keeps them)."""
        w = self.welcome
        limit = float("inf") if w.limit is None else w.limit
        kept = RemoteKept(self, launcher, dict(job_id=w.kept, world=(w.ranks, w.device, w.backend)), limit)
        kept.cells = w.cells
        return kept

    def lost(self) -> str | None:
        """Why the ranks ended (their idle limit, a cancel: the host's Ended line; the host killed),
        or None when they wait for this kernel's next cell."""
        if self.ended is None and self.sock is not None:
            try:
                ready = readable([self.sock], 0)
                if ready:
                    with channel.noting([]):  # read whole
                        message, _ = channel.recv(self.sock)
                    if isinstance(message, Ended):
                        self.ended = message.line
            except (OSError, EOFError, channel.ProtocolError) as exc:
                log.debug("job %s: its door: %r", self.record, exc)
                self.ended = self.gone_line()
        elif self.sock is None and self.ended is None:
            self.ended = self.gone_line()
        return self.ended

    def gone_line(self) -> str:
        return self.ended or (f"taas: job {self.record}'s host ended without a word (killed?); its kept "
                              "ranks ended with it")

    def close(self) -> None:
        """Let go: the ranks wait for the next kernel (until their idle limit)."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def first_cell(store: Store, job_id: str, take=None) -> Returned | None:
    """A kept job's first cell, once, for the notebook that adopts its ranks: rank 0's names
    and Out[] (None when another notebook took them), or its failure raised.  ``take(store,
    record)``: how results are taken from this store (default: this machine's, client.take)."""
    import json

    from taas.host import client
    from taas.host.api import FAILURE

    data = store.claim(job_id, FAILURE)
    if data is not None:
        failure = json.loads(data)
        raise failure_raised(CellFailed(failure.get("summary", ""), list(failure.get("rendered") or ()),
                                  failure.get("kind", "JobFailed")))
    try:
        return (take or client.take)(store, store.read(job_id))
    except JobError:  # taken already (by the kernel that started it, or an earlier attach)
        return None
