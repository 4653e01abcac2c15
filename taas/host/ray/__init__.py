"""Detached jobs on a Ray cluster: the job host is a detached, named Ray actor, the records live
in the cluster's key-value store (the GCS), so the job needs nothing of the kernel that started
it and a new kernel connected to the same cluster lists it, attaches to it and takes its results.

    kernel (client.py)                               the cluster
      start_there(): the job made by the kernel's    JobHost (actor.py): lifetime="detached",
        Session on its cluster launcher (Prepared)     named in taas's namespace, num_cpus=0;
      start(): the record WAITING in the KV ──────>    runs it (host.main.run_prepared) on a
        the JobHost actor, start(Prepared, ──────>     Ray launcher of its own Session's: the
          its shared files as bytes)                   node agents, ranks, loader workers
      follows the KV until RUNNING,                    are created and owned by it
        says `job ID detached`
      any kernel later: %taas jobs / attach   <────  output log, view, metrics, results, failure,
        (store.py: RayStore, the same calls as         record: KV keys under jobs/USER.UID/ID/
        this machine's Store; the local host's
        Follower reads it through log_reader)
      %taas cancel: the actor's cancel(secret) ──>   the cell interrupted: every process stopped

The host comes first: the kernel's spare (spares.py: made ahead after a detached cell, warm: its
Session, the GPU nodes' agents), else one made for the cell; either ends itself if the kernel goes
before it has a job.  It tells the kernel how many CUDA devices the ranks see (``cuda_devices``,
from the agents it starts for the job anyway), so a kernel that only detaches starts no node
agents of its own; a cell that fails before its job is handed over leaves it as the spare.

A ``--keep --detach`` job's host keeps the ranks after the first cell and serves them at a TCP
door of its node (door.py, taas.host.kept's KeptHost): a kernel connected later adopts them.

Ownership: the node agents are actors the host creates, so Ray ends them, and their ranks and
loader workers with them, when the host actor dies (ray.kill, its worker SIGKILLed, its node
lost); a record still saying running whose actor is gone reads ``lost`` with why.

The contract with the local variant (taas.host's client.py/main.py): a store with ``read``,
``write``, ``put``, ``get``, ``listing``, ``resolve``, ``remove``, ``log_reader``, ``read_view``;
``client.follow``, ``running_copy`` and ``raise_failure`` take either store; ``start``,
``take`` and ``cancel`` have a variant here.

May import: taas.host (its client's Follower, the host's run_prepared, the RecordSink, api, wire),
taas.jobs, taas.session, taas.launch.ray (the cluster connection), taas.errors, taas.shield
(a cancel lands at the supervisor's next checkpoint).
"""
