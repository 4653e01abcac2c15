"""The job host: a detached job's supervisor, in a process of its own that outlives the kernel.

    kernel (detach.py, client.py)               host (main.py, ``python -m taas.host``)
      the Job, made by the kernel's ──job.pkl──>  the supervisor an attached job has runs it:
      Session as an attached cell's  + its fds     its own launcher, ranks (its descendants)
      (api.Prepared; --keep: the first cell on kept ranks, which the host then keeps)
      follows the record's output log  <──log──   every sink call as a record (sink.py)
      takes rank 0's names and Out[]   <──────    api.Returned in results.pkl, state in record.json

The host leads a session of its own (``setsid``), has no terminal and no pipe to the kernel, and
holds its record's lock for its life: when it dies, its launcher's guard ends the ranks (as a
kernel's death does today) and the record reads ``lost``.  A kernel, a second notebook or a
terminal (:mod:`taas.cli`) are viewers: they read the record, never the host's memory.

Hosts are kept ready ahead of need (spares.py), forked by a warm process of the kernel's, its
zygote (zygote.py), so that detached cells back to back each find one.

A kernel's attached jobs run in a host too, its own (serve.py; remote.py is the kernel's side;
``TAAS_ATTACHED_IN_HOST=0``: in the kernel, as before): a child that ends with the kernel, sent
each prepared Job, sending every Sink call back as it happens (wire.py).

With ``--keep --detach`` the ranks stay after the cell and the host serves them at a door (a
socket in the record folder: kept.py, channel.py): one kernel at a time adopts them, proving
the job's secret (adopt.py), and they are its kept ranks as if its own job host kept them: its
Session prepares each later cell and sends it there with the same frames (wire.py).

May import: taas.session (the host runs a Session), taas.cellrun (the cell read as an attached
cell's is), taas.jobs, taas.job, taas.io, taas.data, taas.directive, taas.workdir, taas.errors,
taas.supervisor (kept ranks' value fingerprints, so that an adopting kernel sends only what
their host lacks; the Supervisor, which the kernel's own host runs), taas.wiring (the launcher
the kernel's own host runs jobs on), taas.shield (its answers sent whole, never cut by an
interrupt) and taas.ready (poll(2)).
"""
