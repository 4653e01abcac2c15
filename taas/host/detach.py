"""The kernel's side of starting a detached job (``--detach``).

On this machine the job is made by the kernel's Session exactly as an attached cell's is (the
cell read, its values shipped, its GPUs leased: :meth:`taas.session.Session.detached_job`) and
handed to a job host as it is, with its shared files (:class:`~taas.host.api.Prepared`); the
host runs it with the supervisor an attached job has (:func:`taas.host.main.run_prepared`), a
``--keep`` one as the first cell on kept ranks, which the host then keeps for the kernel that
adopts them (taas.host.kept: that kernel's Session prepares each later cell, as for its own
job host's kept ranks).  A job on a Ray cluster is made the same way on the cluster's launcher
and goes to a host actor there (taas.host.ray.client.start_there).
"""

from __future__ import annotations

from taas.host import client
from taas.host.api import Prepared
from taas.host.cells import cell_sources
from taas.jobs.api import JobRecord


def start_here(session, store, source: str, namespace: dict, options, *, filename: str, text: str,
               hidden: frozenset, name_for, notebook: str, hashed: str, sink, hosts) -> JobRecord:
    """Start the cell's detached job under one of ``hosts``; its record once its ranks run
    (see :func:`taas.host.client.start`)."""
    job_id = client.fresh_id(store)

    def hand_over(job, shown: tuple, seen: int) -> JobRecord:
        sources = cell_sources()  # the notebook's cells, and how each is named ("Cell In[7]")
        labels = {name: label for name in sources if (label := name_for(name))}
        return client.start(store, Prepared(job, sources, labels, shown, options.keep), ranks=job.world.size,
                            where="this machine", notebook=notebook, sink=sink, hosts=hosts, hashed=hashed,
                            job_id=job_id, skip=seen)  # the cell showed those lines already

    return session.detached_job(source, namespace, options, job_name=job_id, hand_over=hand_over,
                                filename=filename, first_line=2, sink=sink, hidden=hidden, name_for=name_for,
                                text=text)
