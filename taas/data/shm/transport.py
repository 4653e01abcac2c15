"""The one-machine transport: the contract of :mod:`taas.data.transport` over shared memory.

Per job, the kernel's :class:`ShmTransport` makes, for each loader, a header segment
``/dev/shm/taas-<job>-<loader>`` (the control words, :mod:`taas.data.shm.segment`) and two FIFOs
per channel in a private directory it creates (mode 0700, ``taas-<job>-data-*`` under the
temporary directory).  The kernel holds every FIFO open: a FIFO's bytes vanish when nobody has
it open, and a fast worker may send everything and exit before its rank opens the FIFO.  The
bytes travel in blocks the workers create (:mod:`taas.data.shm.ring`), named after the header.

:meth:`ShmTransport.close` and the cleanup hook (:func:`cleanup`, run by the launcher when the
attempt's processes ended or the kernel died) remove the same things: the attempt's segments,
by whole name (:func:`taas.data.shm.segment.unlink_job`: never the next attempt's, which the
late hook may find already made), and the FIFO directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from taas.data.shm import segment
from taas.data.shm.ring import ShmReceiver, ShmSender
from taas.data.transport import (
    Address, ControlState, Endpoint, Hook, Transport, WorkerControl, WorkerStatus,
)

ENDPOINT = "taas.data.shm.transport:ShmEndpoint"


class ShmTransport(Transport):
    def __init__(self, job_id: str):
        super().__init__(job_id)
        self.directory = tempfile.mkdtemp(prefix=f"{segment.SHM_PREFIX}{job_id}-data-")
        self.headers: dict[int, segment.Segment] = {}
        self._fds: list[int] = []

    def channels(self, loader, workers, pairs, buffer_bytes) -> Address:
        layout = segment.Layout(workers, len(pairs), int(buffer_bytes) // max(len(pairs), 1))
        header = self.headers[loader] = segment.Segment.create(segment.segment_name(self.job_id, loader), layout)
        for channel in range(len(pairs)):
            paths = segment.make_fifos(self.directory, loader, channel)
            self._fds += [os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in paths]
        return Address(ENDPOINT, {"segment": header.name, "directory": self.directory, "loader": loader})

    def control(self, loader: int) -> ControlState:
        seg = self.headers[loader]
        now = time.monotonic()
        workers = [WorkerStatus(
            state=seg.worker(w, segment.W_STATE), unit=seg.worker(w, segment.W_UNIT),
            busy_s=now - seg.worker_since(w), prefetched=bool(seg.worker(w, segment.W_PREFETCHED)),
            produced=seg.worker(w, segment.W_PRODUCED),
        ) for w in range(seg.layout.workers)]
        wanted = {}
        for channel in range(seg.layout.channels):
            want = seg.channel(channel, segment.C_WANT)
            if want:
                wanted[channel] = (want - 1, now - seg.want_since(channel))
        return ControlState(workers, wanted)

    def fail(self, loader: int, worker: int, text: str) -> None:
        header = self.headers.get(loader)
        if header is not None:
            header.set_failure(worker, text)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        while self.headers:
            _, header = self.headers.popitem()
            try:
                header.close()
            except Exception:  # closing is best effort; the segments are unlinked below regardless
                pass
        cleanup(self.job_id, self.directory)

    def cleanup(self) -> Hook:
        return (f"{__name__}:cleanup", (self.job_id, self.directory))


def cleanup(job_id: str, directory: str) -> None:
    """Unlink every shared-memory segment of job ``job_id`` and remove its FIFO directory
    (from any process: the kernel's, or the launcher's when the kernel died)."""
    segment.unlink_job(job_id)
    shutil.rmtree(directory, ignore_errors=True)


class _Worker(WorkerControl):
    def __init__(self, seg: segment.Segment, worker: int):
        self.seg, self.index = seg, worker

    def set_state(self, state: int, unit: int = 0) -> None:
        self.seg.set_worker_state(self.index, state, unit)

    def produced(self, count: int) -> None:
        self.seg.set_worker(self.index, segment.W_PRODUCED, count)

    def prefetched(self) -> None:
        self.seg.set_worker(self.index, segment.W_PREFETCHED, 1)


class ShmEndpoint(Endpoint):
    """A job process's view of one loader: its header mapped, FIFOs opened per channel."""

    def __init__(self, address: Address):
        super().__init__(address)
        where = address.where
        self.seg = segment.Segment.attach(where["segment"])
        self._directory, self._loader = where["directory"], where["loader"]

    def sender(self, channel, on_wait=None):
        return ShmSender(self.seg, channel, self._fifos(channel), on_wait)

    def receiver(self, channel, pin_memory=False):
        return ShmReceiver(self.seg, channel, self._fifos(channel), pin_memory)

    def _fifos(self, channel: int) -> tuple[str, str]:
        return segment.fifo_paths(self._directory, self._loader, channel)

    def worker(self, worker: int) -> WorkerControl:
        return _Worker(self.seg, worker)

    def want(self, channel: int, unit: int | None) -> None:
        self.seg.set_want(channel, unit)

    def prefetched(self, worker: int) -> bool:
        return bool(self.seg.worker(worker, segment.W_PREFETCHED))

    def failure(self) -> str | None:
        failed = self.seg.failure()
        return None if failed is None else failed[1]

    def close(self) -> None:
        """Unmap the header (its receivers released first: a kept rank's view, per cell)."""
        try:
            self.seg.close()
        except BufferError:  # still viewed somewhere: it goes with the process
            pass
