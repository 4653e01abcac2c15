"""The start process's answers, routed to the job they are about.

The launcher has one channel to its start process (:mod:`taas.launch.local.protocol`), and
whichever job waits reads it.  Usually one job runs at a time, but kept ranks (``--keep``) live
across cells while each cell that reads registered loaders runs its loader workers as a job of
their own next to them: the loader job may read the kept ranks' ``Exited`` (and the kept job
the loader job's ``Stopped``).  Dropping a message about another job would lose it, so each
live job has a box here, and a message about another live job goes into that job's box; the
job reads its box before the channel.  A message about no live job (a late answer about an
ended job) is dropped, as before.
"""

from __future__ import annotations

import collections
import logging

log = logging.getLogger(__name__)


class Mailboxes:
    """One box per live job of a launcher (all on one thread: the kernel's cell)."""

    def __init__(self) -> None:
        self._boxes: dict[str, collections.deque] = {}

    def open(self, job_id: str) -> collections.deque:
        """The box of job ``job_id``, live from now until :meth:`close`."""
        return self._boxes.setdefault(job_id, collections.deque())

    def close(self, job_id: str) -> None:
        self._boxes.pop(job_id, None)

    def route(self, message) -> None:
        """``message`` (about another job than the reader's) into its job's box, or dropped
        when that job is not live (a late answer about an ended one)."""
        box = self._boxes.get(getattr(message, "job_id", None))
        if box is not None:
            box.append(message)
        elif message is not None:
            log.debug("taas: dropped a %s about no live job", type(message).__name__)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._boxes
