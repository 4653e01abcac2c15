"""The kernel's side of starting a detached job (``--detach``).

On this machine the job is made by the kernel's Session exactly as an attached cell's is (the
cell read, its values shipped, its GPUs leased: :meth:`taas.session.Session.detached_job`) and
handed to a job host as it is, with its shared files (:class:`~taas.host.api.Prepared`); the
host runs it with the supervisor an attached job has (:func:`taas.host.main.run_prepared`), a
``--keep`` one as the first cell on kept ranks, which the host then keeps for the kernel that
adopts them (taas.host.kept: that kernel's Session prepares each later cell, as for its own
job host's kept ranks).  A job on a Ray cluster goes as a :class:`~taas.host.api.Request`
(:func:`request_for`), which the host actor makes a job of (taas.host.ray).
"""

from __future__ import annotations

from taas.host import client
from taas.host.api import Prepared, Request
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


def request_for(source: str, namespace: dict, options: str, *, filename: str, label: str | None,
                first_line: int, hidden: frozenset = frozenset(), name_for=None,
                text: str | None = None) -> Request:
    """The cell as a host's Request: everything that can refuse it before a host starts fails
    here, as for an attached cell (a syntax error, a value that cannot be shipped)."""
    from taas.data import registry
    from taas.job import package
    from taas.cellrun import read_cell
    from taas.workdir.cwd import working_directory

    cwd = working_directory()
    _, values = read_cell(source, namespace, filename, first_line, hidden, name_for)
    loaders = {}
    for name, value in values.items():
        entry = registry.entry(value)
        if entry is not None:
            loaders[name] = (entry.prefetch, entry.buffer_mb)
    return Request(source=source, options=options, names=package.ship(values), filename=filename,
                   label=label, first_line=first_line, cwd=cwd, loaders=loaders, text=text)
